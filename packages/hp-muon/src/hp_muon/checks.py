"""What Muon accepts: groups of parameters that are matrices by their *global* shape.

A parameter is a matrix (or a stack of matrices, ``[E, out, in]``) when its global shape has at
least 2 dims. The global shape is the whole parameter's, not this rank's piece: a torch or
hp-dtensor ``DTensor`` reports it, and a plain tensor annotated with its layout (hp-fsdp's flat
layout, hp-dtensor production-mode tensor parallelism) reports it through
``hp_dtensor.layout_of``. So a 1-d flat piece of a 2-d matrix is a matrix; a parameter whose
global shape has fewer than 2 dims (a bias, a norm, a scalar) is not, and neither is a group with
no parameters: both are errors rather than a silent step over nothing.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from hp_muon.tensors import global_shape, is_plain

__all__ = ["FLAT_LAYOUT_HINT", "check_muon_params", "flat_pieces_of_matrices"]

FLAT_LAYOUT_HINT = (
    "hp-fsdp's flat layout (the default of hp_fsdp.fully_shard) hands out 1-d pieces whatever "
    "the parameter's shape, so a `p.ndim == 2` rule selects none of them: shard with "
    'hp_fsdp.fully_shard(..., param_layout="per_param") for parameters of their global shape '
    "(as torch FSDP2 and hyper_parallel.fully_shard), or select by global shape "
    "(len(hp_dtensor.layout_of(p).global_shape) >= 2, as hp_muon.split_params does)"
)
"""How to get parameters Muon accepts out of a flat FSDP layout (quoted by the errors)."""


def flat_pieces_of_matrices(
    named: Iterable[tuple[str, torch.Tensor]],
) -> list[tuple[str, tuple[int, ...], tuple[int, ...]]]:
    """``(name, local shape, global shape)`` of each parameter of ``named`` that is a 1-d flat
    piece (an annotated plain tensor, as hp-fsdp's flat layout gives) of a tensor with at least
    2 dims: what a ``p.ndim == 2`` rule misses."""
    return [
        (name, tuple(p.shape), shape)
        for name, p in named
        if not is_plain(p) and p.dim() == 1 and len(shape := global_shape(p)) >= 2
    ]


def _name(names: Sequence[str] | None, index: int) -> str:
    return repr(names[index]) if names is not None and index < len(names) else f"{index}"


def _not_a_matrix(p: torch.Tensor, name: str, where: str) -> str:
    shape = global_shape(p)
    what = f"{where}: parameter {name} has global shape {shape}, not a matrix"
    if not is_plain(p) and p.dim() == 1:
        what += (
            f" (this rank holds a 1-d flat piece of shape {tuple(p.shape)}; the whole "
            f'parameter has {len(shape)} dim(s), so param_layout="per_param" would not make '
            "it a matrix either)"
        )
    elif is_plain(p) and p.dim() == 1:
        what += (
            " (if it is a flat FSDP shard of a matrix from a sharder that records no layout, "
            'shard per parameter instead: hp_fsdp.fully_shard(..., param_layout="per_param") '
            "or torch FSDP2 give parameters of their global shape; or annotate its layout with "
            "hp_dtensor.annotate_layout)"
        )
    return (
        f"{what}. Muon orthogonalizes matrices (2 or more dims); optimize it with AdamW "
        "(hp_muon.split_params sends parameters with fewer than 2 dims there)"
    )


def check_muon_params(
    params: Sequence[torch.Tensor],
    where: str,
    *,
    names: Sequence[str] | None = None,
    model_params: Iterable[tuple[str, torch.Tensor]] = (),
) -> None:
    """Check that ``params`` is a group Muon can step.

    Args:
        params: the group's parameters.
        where: how errors name the group (``"Muon parameter group 0"``).
        names: the parameters' names, if known (else errors give their index).
        model_params: the model's named parameters, if known: an empty group's error then
            names the flat pieces of matrices a ``p.ndim == 2`` rule missed.

    Raises:
        ValueError: ``params`` is empty, or a parameter's global shape has fewer than 2 dims
            (the message names it and what to do instead).
    """
    if not params:
        missed = flat_pieces_of_matrices(model_params)
        found = ""
        if missed:
            name, local, shape = missed[0]
            found = (
                f"; the model holds {len(missed)} 1-d flat piece(s) of matrices, e.g. "
                f"{name!r} of local shape {local} and global shape {shape}"
            )
        raise ValueError(
            f"{where} has no parameters: Muon would step nothing and every matrix would train "
            f"with another optimizer{found}. Give Muon the parameters whose global shape has 2 "
            f"or more dims; {FLAT_LAYOUT_HINT}. To train everything with AdamW, use "
            "torch.optim.AdamW alone"
        )
    for i, p in enumerate(params):
        if len(global_shape(p)) < 2:
            raise ValueError(_not_a_matrix(p, _name(names, i), where))
