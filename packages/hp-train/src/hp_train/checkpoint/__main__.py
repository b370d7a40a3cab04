"""``python -m hp_train.checkpoint mark-legacy DIR``: mark a checkpoint written before hp-train
wrote ``manifest.json`` as such, so that ``--resume`` and ``--resume-from`` load it unverified
(with a warning, after a structural check) instead of refusing it.

A checkpoint without a manifest is refused unless marked: deleting the manifest must not
switch the integrity check off. The command refuses a checkpoint that has a manifest, and one
whose ``.metadata`` holds the format marker of this version (its manifest was deleted:
:func:`hp_train.checkpoint.dcp.mark_legacy`). One process, no process group; exit status 0,
or 2 with the reason on stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hp_train.checkpoint.dcp import CheckpointError, mark_legacy

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; returns the exit status."""
    parser = argparse.ArgumentParser(
        prog="python -m hp_train.checkpoint", description=__doc__.split("\n\n")[0]
    )
    commands = parser.add_subparsers(dest="command", required=True)
    mark = commands.add_parser(
        "mark-legacy",
        help="mark a checkpoint without manifest.json as written before manifests existed",
    )
    mark.add_argument("checkpoint", type=Path, help="a checkpoint step folder (step_NNNNNN)")
    args = parser.parse_args(argv)
    try:
        written = mark_legacy(args.checkpoint)
    except CheckpointError as exc:
        print(f"hp-train checkpoint: {exc}", file=sys.stderr, flush=True)
        return 2
    print(
        f"marked {args.checkpoint} as written before manifests ({written.name}): --resume and "
        "--resume-from load it unverified, with a warning",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
