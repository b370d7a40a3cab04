"""The block that opens each run in a rank's log file, and the line that closes it.

Runs in one output folder append to the same ``logs/rank_<r>.log``; the header separates
them and says what ran::

    ==== hp-train 0.1.0: run begins ====
    command: python -m hp_train --steps 40 --tp 2
    configuration: sha256 3f2a9c1d0b7e (of hp_train_config.json's fields)
    world: 4 ranks, this one rank 1; mesh dp_replicate 1 x dp_shard 2 x cp 1 x tp 2 x pp 1
    device: cpu
    model FLOPs: 1.23e+06 per token (forward + backward, seq_len 64)
    peak FLOP/s per rank: 0.166 TFLOP/s (estimated: 1 thread(s) x 2.60 GHz x 64 fp32 ...)

and the run ends with ``==== run ends: <summary> ====`` or ``==== run stopped: <error>
====``. Everything here is pure: the trainer passes the facts.
"""

from __future__ import annotations

import hashlib
import json
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import PurePath

__all__ = [
    "END_MARK",
    "HEADER_MARK",
    "STOP_MARK",
    "RunFacts",
    "command_line",
    "config_hash",
    "end_line",
    "header_lines",
    "stop_line",
]

#: The first line of every run's header (the version follows ``hp-train``).
HEADER_MARK = "==== hp-train"
#: The start of a run's last line when it finished.
END_MARK = "==== run ends:"
#: The start of a run's last line when an error or a signal stopped it.
STOP_MARK = "==== run stopped:"


def config_hash(record: Mapping[str, object]) -> str:
    """The first 12 hex digits of the SHA-256 of ``record`` as canonical JSON (keys sorted,
    no spaces): two runs of the same resolved configuration have the same hash.

    Raises:
        TypeError: a value JSON cannot hold.
    """
    text = json.dumps(record, sort_keys=True, separators=(",", ":"), allow_nan=True)
    return hashlib.sha256(text.encode()).hexdigest()[:12]


def command_line(argv: Sequence[str]) -> str:
    """``argv`` as a shell would take it back: ``python -m hp_train <args>`` when
    ``argv[0]`` is hp_train's ``__main__.py`` (how ``-m hp_train`` and torchrun's ``-m``
    show it), else ``argv`` quoted as it is."""
    if argv and PurePath(argv[0]).parts[-2:] == ("hp_train", "__main__.py"):
        return shlex.join(["python", "-m", "hp_train", *argv[1:]])
    return shlex.join(argv)


@dataclass(frozen=True)
class RunFacts:
    """What a run's header says.

    Attributes:
        version: hp-train's version.
        command: the command line (:func:`command_line`).
        config_hash: :func:`config_hash` of the run record.
        world_size: ranks of the job.
        rank: the rank whose log this is.
        mesh: each parallel dimension and its size, in order (``dp_replicate`` first).
        device: the rank's device, e.g. ``cpu`` or ``cuda:1 (NVIDIA H100 80GB HBM3)``.
        flops_per_token: model FLOPs of one training token (forward + backward).
        seq_len: the sequence length those FLOPs are for.
        peak_flops: the rank's peak FLOP/s, or None where unknown.
        peak_how: how the peak was made (given, estimated from what, or why unknown).
    """

    version: str
    command: str
    config_hash: str
    world_size: int
    rank: int
    mesh: Mapping[str, int]
    device: str
    flops_per_token: int
    seq_len: int
    peak_flops: float | None
    peak_how: str


def header_lines(facts: RunFacts) -> list[str]:
    """The header block, one string per line (module docstring)."""
    mesh = " x ".join(f"{name} {size}" for name, size in facts.mesh.items())
    peak = "n/a" if facts.peak_flops is None else f"{facts.peak_flops / 1e12:.3g} TFLOP/s"
    return [
        f"{HEADER_MARK} {facts.version}: run begins ====",
        f"command: {facts.command}",
        f"configuration: sha256 {facts.config_hash} (of hp_train_config.json's fields)",
        f"world: {facts.world_size} ranks, this one rank {facts.rank}; mesh {mesh}",
        f"device: {facts.device}",
        f"model FLOPs: {facts.flops_per_token:.3g} per token (forward + backward, "
        f"seq_len {facts.seq_len})",
        f"peak FLOP/s per rank: {peak} ({facts.peak_how})",
    ]


def end_line(summary: str) -> str:
    """The last line of a run that finished: ``==== run ends: <summary> ====``."""
    return f"{END_MARK} {summary} ===="


def stop_line(error: BaseException, step: int | None) -> str:
    """The last line of a run an error or a signal stopped: ``==== run stopped: <type>:
    <message> ====``, with `` (during step <step>)`` (1-based) when it was in a step, and
    the message's lines joined by `` / `` so that it stays one line."""
    where = "" if step is None else f" (during step {step})"
    message = " / ".join(line for line in str(error).splitlines() if line.strip())
    what = type(error).__name__ + (f": {message}" if message else "")
    return f"{STOP_MARK} {what}{where} ===="
