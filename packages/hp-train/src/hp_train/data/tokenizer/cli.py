"""``python -m hp_train.data.tokenizer train``: a byte-level BPE trained on local text.

    python -m hp_train.data.tokenizer train --data pydoc --vocab-size 2048 --out tok/

It trains on the documents the training run will train on: pass the run's ``--eval-fraction``
and ``--seed``, and its held-out documents stay unseen by the tokenizer too.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from hp_train.config.schema import ConfigError

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hp_train.data.tokenizer", description=__doc__)
    commands = p.add_subparsers(dest="command", required=True)
    train = commands.add_parser("train", help="train a byte-level BPE on local text")
    train.add_argument(
        "--data", required=True, help="'pydoc', 'corpus' or a local text/JSON Lines/Parquet path"
    )
    train.add_argument("--vocab-size", type=int, required=True, help="tokens, at least 257")
    train.add_argument("--out", type=Path, required=True, help="the folder to write")
    train.add_argument("--text-field", default="text", help="the field of JSON Lines/Parquet rows")
    train.add_argument(
        "--eval-fraction",
        type=float,
        default=0.0,
        help="the training run's share of held-out documents (left out here too)",
    )
    train.add_argument("--seed", type=int, default=0, help="the training run's seed")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line ``argv`` (default ``sys.argv[1:]``); 0 on success, 2 (with the
    reason on stderr) on bad input."""
    parser = _parser()
    args = parser.parse_args(argv)
    # Imported here: a bad command line fails before the data modules load.
    from hp_train.data.documents import training_texts
    from hp_train.data.spec import DataSpec
    from hp_train.data.tokenizer.bpe import train_bpe
    from hp_train.data.tokenizer.hf import load_tokenizer

    try:
        spec = DataSpec(args.data, text_field=args.text_field, eval_fraction=args.eval_fraction)
        texts = training_texts(
            spec.source, text_field=spec.text_field, eval_fraction=spec.eval_fraction,
            seed=args.seed,
        )  # fmt: skip
        out = train_bpe(texts, args.vocab_size, args.out)
        tokenizer = load_tokenizer(out)
    except ConfigError as err:
        print(f"{parser.prog} train: error: {err}", file=sys.stderr)
        return 2
    held = f", {spec.eval_fraction:g} of the documents held out (seed {args.seed})"
    print(
        f"wrote {out}: byte-level BPE, vocab {tokenizer.vocab_size}, end of sequence "
        f"{tokenizer.eos_token!r} = id {tokenizer.eos_id}; trained on {spec.source}"
        + (held if spec.eval_fraction else "")
    )
    return 0
