"""The ways a caller forms a loss from a model, for gradient tests of parallel executors.

A parallel executor can be right for ``loss(model(x)).backward()`` and wrong for everything
else: a loss on a chain of submodules the caller runs itself, on an intermediate tensor, on a
parameter, on two forwards of one module, or with activation checkpointing around the
modules. Each *call path* here is a function ``(model, ids, targets) -> [losses]`` over an
:class:`hp_testing.llama.Llama` (or anything with its module names: ``tok_embeddings``,
``layers`` (a list, or a dict keyed by index), ``norm``, ``output``, the ``cos``/``sin``
buffers, blocks called as ``block(x, cos, sin)``: hp-train's model too). The caller runs
``backward()`` on each loss in turn (two entries: gradient accumulation over two backward
passes), on a single-device model and on the parallel one, and compares the gradients.

Every path is written with plain module calls and plain tensor ops, so it runs unchanged on a
single-device model, on an hp-dtensor production model and on a model parallelized by
``torch.distributed.tensor.parallel`` (whose unplanned parameters, the norms, stay plain).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from types import MethodType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

__all__ = [
    "PATHS",
    "CallPath",
    "checkpointed_blocks",
    "cross_entropy",
    "penalized_parameters",
    "worst_gradient_error",
]

# The model is typed ``Any``: paths reach into its submodules by name.
CallPath = Callable[[Any, torch.Tensor, torch.Tensor], list[torch.Tensor]]

PENALTY = 0.1


def cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``[batch, seq, vocab]`` logits."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def penalized_parameters(model: Any) -> list[torch.Tensor]:
    """The parameters the ``penalty`` path puts in the loss, as plain tensors: the norms'
    scales, replicated by every tensor-parallel plan (the same values on every rank; a torch
    DTensor under torch's sequence parallelism, read through ``to_local()``, whose gradient
    torch takes as replicated)."""
    first: Any = _blocks(model)[0]
    out: list[torch.Tensor] = []
    for p in (model.norm.weight, first.attn_norm.weight):
        torch_dtensor = type(p).__module__.startswith("torch.distributed")
        out.append(p.to_local() if torch_dtensor else p)
    return out


def _blocks(model: Any) -> list[nn.Module]:
    """The blocks in order (``layers`` a list, or a dict keyed by index as hp-train keeps it)."""
    layers = model.layers
    return list(layers.values() if isinstance(layers, nn.ModuleDict) else layers)


def _tables(model: Any, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    seq = ids.shape[1]
    cos: torch.Tensor = model.cos[:seq]
    sin: torch.Tensor = model.sin[:seq]
    return cos, sin


def _root(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    return [cross_entropy(model(ids), targets)]


def _chain(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    # The caller runs every submodule itself, as a chunked or fused loss does with the head.
    cos, sin = _tables(model, ids)
    x = model.tok_embeddings(ids)
    for layer in _blocks(model):
        x = layer(x, cos, sin)
    return [cross_entropy(model.output(model.norm(x)), targets)]


def _intermediate(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    # A term on the first block's output, which also feeds the next block.
    cos, sin = _tables(model, ids)
    x = model.tok_embeddings(ids)
    first = _blocks(model)[0](x, cos, sin)
    x = first
    for layer in _blocks(model)[1:]:
        x = layer(x, cos, sin)
    logits = model.output(model.norm(x))
    return [cross_entropy(logits, targets) + 0.05 * first.pow(2).mean()]


def _twice(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    # Two forwards of the same modules in one backward.
    return [cross_entropy(model(ids), targets) + 0.5 * cross_entropy(model(ids.flip(1)), targets)]


def _penalty(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    loss = cross_entropy(model(ids), targets)
    for p in penalized_parameters(model):
        loss = loss + PENALTY * (p - 0.5).pow(2).sum()
    return [loss]


def _accumulate(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    # Two backward passes into the same gradients (accumulation over two micro-batches);
    # each loss is built right before its backward.
    half = ids.shape[0] // 2
    return [
        0.5 * cross_entropy(model(ids[:half]), targets[:half]),
        0.5 * cross_entropy(model(ids[half:]), targets[half:]),
    ]


@contextlib.contextmanager
def checkpointed_blocks(model: Any, *, use_reentrant: bool) -> Iterator[None]:
    """Each block's forward run through ``torch.utils.checkpoint`` (the block's own hooks stay
    outside, its submodules' inside) while the context lasts."""
    blocks = _blocks(model)
    for block in blocks:
        inner = type(block).forward

        def forward(self: nn.Module, *args: Any, _inner: Any = inner) -> Any:
            return checkpoint(_inner, self, *args, use_reentrant=use_reentrant)

        block.forward = MethodType(forward, block)
    try:
        yield
    finally:
        for block in blocks:
            del block.forward


def _checkpoint_inside(use_reentrant: bool) -> CallPath:
    def path(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
        with checkpointed_blocks(model, use_reentrant=use_reentrant):
            return [cross_entropy(model(ids), targets)]

    return path


def _checkpoint_chain(model: Any, ids: torch.Tensor, targets: torch.Tensor) -> list[torch.Tensor]:
    # The caller checkpoints the blocks it calls itself.
    cos, sin = _tables(model, ids)
    x = model.tok_embeddings(ids)
    for layer in _blocks(model):
        x = checkpoint(layer, x, cos, sin, use_reentrant=False)
    return [cross_entropy(model.output(model.norm(x)), targets)]


#: Every call path by name.
PATHS: dict[str, CallPath] = {
    "root": _root,
    "chain": _chain,
    "intermediate": _intermediate,
    "twice": _twice,
    "penalty": _penalty,
    "accumulate": _accumulate,
    "checkpoint": _checkpoint_inside(use_reentrant=False),
    "checkpoint_reentrant": _checkpoint_inside(use_reentrant=True),
    "checkpoint_chain": _checkpoint_chain,
}


def worst_gradient_error(
    model: nn.Module, reference: nn.Module, whole: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[float, str]:
    """The largest error of ``model``'s gradients against ``reference``'s (same parameter
    order), each relative to the reference gradient's largest entry, and the parameter's name;
    ``whole(param)`` gives a parameter's whole gradient (gathering a sharded one). A parameter
    of ``model`` without a gradient is an infinite error."""
    worst, name = 0.0, ""
    for (n, p), (_, q) in zip(model.named_parameters(), reference.named_parameters(), strict=True):
        if q.grad is None:
            raise AssertionError(f"the reference's {n} has no gradient")
        if p.grad is None:
            return float("inf"), f"{n} (no gradient)"
        got = whole(p).reshape(q.shape)
        err = ((got - q.grad).abs().max() / q.grad.abs().max().clamp_min(1e-30)).item()
        if err > worst:
            worst, name = err, n
    return worst, name
