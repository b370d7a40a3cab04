"""Following tensors through whatever structure a module takes or returns.

Module outputs come as plain tensors, tuples and lists, named tuples, dicts, dataclasses and
Hugging Face ``ModelOutput`` objects (an ``OrderedDict`` dataclass registered with
``torch.utils._pytree``), nested in any way. Boundary conversions must reach every tensor in
them: a tensor that a boundary skips keeps the wrong gradient convention, and its gradients come
out scaled by the mesh size with nothing to show for it. So :func:`map_tensors` either reaches
every tensor or raises naming the object it cannot look into.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch.utils import _pytree as pytree

__all__ = ["UnfollowableOutputError", "map_tensors", "rebuild_sequence"]

# Leaves that cannot hold a tensor.
_ATOMS = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, type)


class UnfollowableOutputError(TypeError):
    """A module took or returned an object holding tensors that boundaries cannot follow."""


def _holds_tensor(value: Any, depth: int = 0) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if depth > 4 or isinstance(value, _ATOMS):
        return False
    try:
        attributes = vars(value)
    except TypeError:
        return False
    return any(_holds_tensor(v, depth + 1) for v in attributes.values())


def map_tensors(fn: Callable[[torch.Tensor], torch.Tensor], value: Any, *, where: str) -> Any:
    """``value`` with every tensor in it replaced by ``fn(tensor)``, the structure kept.

    Postconditions: every tensor reachable through pytree containers (tuples, lists, named
    tuples, dicts, ``ModelOutput``) and dataclass fields is passed to ``fn`` exactly once (by
    position); the result has the same container types, keys and non-tensor leaves.

    Raises:
        UnfollowableOutputError: an object that is none of those holds a tensor in its
            attributes (``where`` names the module); register its type with
            ``torch.utils._pytree.register_pytree_node`` or return a tuple or dict.
    """
    leaves, spec = pytree.tree_flatten(value)
    return pytree.tree_unflatten([_map_leaf(fn, leaf, where) for leaf in leaves], spec)


def _map_leaf(fn: Callable[[torch.Tensor], torch.Tensor], leaf: Any, where: str) -> Any:
    if isinstance(leaf, torch.Tensor):
        return fn(leaf)
    if isinstance(leaf, _ATOMS):
        return leaf
    if dataclasses.is_dataclass(leaf) and not isinstance(leaf, type):
        fields = dataclasses.fields(leaf)
        if all(f.init for f in fields):
            changes = {f.name: map_tensors(fn, getattr(leaf, f.name), where=where) for f in fields}
            return dataclasses.replace(leaf, **changes)
    if _holds_tensor(leaf):
        raise UnfollowableOutputError(
            f"{where}: a {type(leaf).__qualname__} holds tensors that the plan's boundaries "
            "cannot follow; return tensors in tuples, lists, dicts or dataclasses, or register "
            "the type with torch.utils._pytree.register_pytree_node"
        )
    return leaf


def rebuild_sequence(like: Any, items: list[Any]) -> Any:
    """A tuple, named tuple or list of the same type as ``like`` holding ``items``."""
    if isinstance(like, tuple) and hasattr(like, "_fields"):
        return type(like)(*items)
    return type(like)(items)
