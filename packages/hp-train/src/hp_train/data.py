"""Training data: a byte-level corpus made of the installed hyper-parallel packages, or
synthetic sequences.

The corpus needs no download and is the same on every machine with the same package
versions: the UTF-8 bytes of every ``.py`` and ``.md`` file of the installed ``hp_*`` packages,
in sorted path order, joined by a separator. Tokens are bytes (vocabulary 256).

Batches are a pure function of ``(seed, step)``: every rank draws the same global batch and
keeps its data-parallel slice, so the data order does not depend on the world size, and a
resumed run sees exactly the batches it would have seen.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

__all__ = ["CORPUS_PACKAGES", "Batch", "TokenSource", "corpus_bytes", "make_source"]

#: Packages whose text makes up the corpus (those installed are used).
CORPUS_PACKAGES: tuple[str, ...] = ("hp_layout", "hp_dtensor", "hp_fsdp", "hp_muon", "hp_train")
_SEPARATOR = b"\n\x00\n"


@dataclass(frozen=True)
class Batch:
    """Inputs and next-token targets, ``[batch, seq]`` int64 each."""

    inputs: torch.Tensor
    targets: torch.Tensor


def corpus_bytes(packages: Sequence[str] = CORPUS_PACKAGES) -> bytes:
    """The corpus: every ``.py``/``.md`` file of the installed ``packages``, sorted by path.

    Raises:
        RuntimeError: none of ``packages`` is installed, or their files hold no text.
    """
    parts: list[bytes] = []
    for name in packages:
        spec = importlib.util.find_spec(name)
        if spec is None or not spec.submodule_search_locations:
            continue
        for root in spec.submodule_search_locations:
            base = Path(root)
            files = sorted(p for p in base.rglob("*") if p.suffix in (".py", ".md"))
            parts += [f"# {name}/{f.relative_to(base)}\n".encode() + f.read_bytes() for f in files]
    if not parts:
        raise RuntimeError(
            f"no corpus: none of {list(packages)} is installed with source files; use "
            "--data synthetic"
        )
    return _SEPARATOR.join(parts)


class TokenSource:
    """Draws global batches of ``seq_len + 1``-token windows, deterministically per step."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, seed: int, name: str) -> None:
        if tokens.dim() != 1 or tokens.numel() < seq_len + 2:
            raise ValueError(
                f"the {name} data has {tokens.numel()} tokens; seq_len={seq_len} needs at least "
                f"{seq_len + 2}"
            )
        self.tokens = tokens
        self.seq_len = seq_len
        self.seed = seed
        self.name = name

    def global_batch(self, step: int, batch: int) -> Batch:
        """The whole batch of ``step`` (identical on every rank)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(0, self.tokens.numel() - self.seq_len - 1, (batch,), generator=g)
        windows = torch.stack([self.tokens[s : s + self.seq_len + 1] for s in starts.tolist()])
        return Batch(windows[:, :-1].contiguous(), windows[:, 1:].contiguous())

    def local_batch(self, step: int, batch: int, dp_rank: int, dp_size: int) -> Batch:
        """This data-parallel rank's equal slice of :meth:`global_batch`."""
        whole = self.global_batch(step, batch)
        return Batch(whole.inputs.chunk(dp_size)[dp_rank], whole.targets.chunk(dp_size)[dp_rank])


def _synthetic_tokens(vocab_size: int, seed: int, length: int = 1 << 16) -> torch.Tensor:
    """Runs of arithmetic progressions modulo the vocabulary (random start and stride per run):
    learnable from context, so the loss falls quickly."""
    g = torch.Generator().manual_seed(seed)
    runs = []
    total = 0
    while total < length:
        start = int(torch.randint(0, vocab_size, (1,), generator=g))
        stride = int(torch.randint(1, 8, (1,), generator=g))
        n = int(torch.randint(16, 64, (1,), generator=g))
        runs.append((start + stride * torch.arange(n)) % vocab_size)
        total += n
    return torch.cat(runs)[:length]


def make_source(kind: str, *, vocab_size: int, seq_len: int, seed: int) -> TokenSource:
    """``"corpus"`` (bytes; needs ``vocab_size >= 256``) or ``"synthetic"``."""
    if kind == "corpus":
        if vocab_size < 256:
            raise ValueError(f"the byte-level corpus needs vocab_size >= 256, got {vocab_size}")
        data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        return TokenSource(data, seq_len, seed, "corpus")
    if kind == "synthetic":
        return TokenSource(_synthetic_tokens(vocab_size, seed), seq_len, seed, "synthetic")
    raise ValueError(f"data must be 'corpus' or 'synthetic', got {kind!r}")
