"""Split a sequential model into pipeline stages.

The decision is pure: :func:`boundaries_by_names`, :func:`balanced_boundaries` (by any
per-layer cost: parameter counts from :func:`parameter_costs`, measured times from
:func:`measured_costs`) return *boundaries*, a tuple ``(0, b1, ..., n)`` where stage ``i`` runs
layers ``[b_i, b_{i+1})``. :func:`build_stages` then cuts the model's layers into one
``nn.Sequential`` per stage (sharing the layer modules, not copying them).

A model is sequential when it is an ``nn.Sequential`` or an ``nn.ModuleList`` (its children in
order), or any module whose ordered blocks are named by ``layers_attr``.
"""

from __future__ import annotations

import itertools
import time
from collections import OrderedDict
from collections.abc import Sequence

import torch
from torch import nn

__all__ = [
    "SplitError",
    "balanced_boundaries",
    "boundaries_by_names",
    "build_stages",
    "layers_of",
    "measured_costs",
    "parameter_costs",
]


class SplitError(ValueError):
    """A split that cannot be made."""


def layers_of(model: nn.Module, layers_attr: str | None = None) -> list[tuple[str, nn.Module]]:
    """The ordered ``(name, layer)`` pairs of a sequential model."""
    if layers_attr is not None:
        container = model.get_submodule(layers_attr)
        if not isinstance(container, nn.Sequential | nn.ModuleList):
            raise SplitError(f"{layers_attr!r} is a {type(container).__name__}, not a sequence")
        return [(f"{layers_attr}.{n}", m) for n, m in container.named_children()]
    if isinstance(model, nn.Sequential | nn.ModuleList):
        return list(model.named_children())
    raise SplitError(
        f"cannot split a {type(model).__name__}: give an nn.Sequential or nn.ModuleList, or name "
        "the attribute holding the ordered blocks with layers_attr"
    )


def _check(boundaries: Sequence[int], num_layers: int) -> tuple[int, ...]:
    out = tuple(boundaries)
    if len(out) < 2 or out[0] != 0 or out[-1] != num_layers:
        raise SplitError(f"boundaries {out} must start at 0 and end at {num_layers}")
    if any(b <= a for a, b in itertools.pairwise(out)):
        raise SplitError(f"boundaries {out} must increase strictly (every stage needs a layer)")
    return out


def boundaries_by_names(layer_names: Sequence[str], first_layers: Sequence[str]) -> tuple[int, ...]:
    """Boundaries where stages 1, 2, ... start at the layers named ``first_layers``."""
    index = {n: i for i, n in enumerate(layer_names)}
    starts = []
    for name in first_layers:
        if name not in index:
            raise SplitError(f"no layer named {name!r}; layers are {list(layer_names)}")
        starts.append(index[name])
    return _check([0, *starts, len(layer_names)], len(layer_names))


def balanced_boundaries(costs: Sequence[float], num_stages: int) -> tuple[int, ...]:
    """Contiguous split of layers with ``costs`` into ``num_stages`` non-empty stages that
    minimizes the largest stage cost (exact dynamic program).

    Ties: the last cut is the earliest that any optimal split has, and the layers before it
    are split the same way (recursively), so equal costs leave the later stages longer.
    """
    n = len(costs)
    if not 1 <= num_stages <= n:
        raise SplitError(f"cannot split {n} layers into {num_stages} non-empty stages")
    if any(c < 0 for c in costs):
        raise SplitError(f"layer costs must be non-negative, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = float("inf")
    # best[k][i]: the smallest max-stage cost of the first i layers in k stages.
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0.0
    for k in range(1, num_stages + 1):
        for i in range(k, n - (num_stages - k) + 1):
            for j in range(k - 1, i):
                value = max(best[k - 1][j], prefix[i] - prefix[j])
                if value < best[k][i]:
                    best[k][i], cut[k][i] = value, j
    bounds = [n]
    for k in range(num_stages, 0, -1):
        bounds.append(cut[k][bounds[-1]])
    return _check(bounds[::-1], n)


def parameter_costs(layers: Sequence[tuple[str, nn.Module]]) -> list[float]:
    """Each layer's parameter count (a layer without parameters costs 0)."""
    return [float(sum(p.numel() for p in m.parameters())) for _, m in layers]


def measured_costs(
    layers: Sequence[tuple[str, nn.Module]], example: torch.Tensor, *, repeats: int = 3
) -> list[float]:
    """Each layer's measured forward + backward time (median of ``repeats``) on ``example``
    passed through the layers in order."""
    costs = []
    x = example
    for _, layer in layers:
        times = []
        for _ in range(repeats):
            inp = x.detach().requires_grad_(x.is_floating_point())
            start = time.perf_counter()
            out = layer(inp)
            if out.requires_grad:
                out.sum().backward()
            times.append(time.perf_counter() - start)
        layer.zero_grad(set_to_none=True)
        costs.append(sorted(times)[len(times) // 2])
        with torch.no_grad():
            x = layer(x)
    return costs


def build_stages(
    layers: Sequence[tuple[str, nn.Module]], boundaries: Sequence[int]
) -> list[nn.Sequential]:
    """One ``nn.Sequential`` per stage holding its layers (the same module objects; names kept
    with dots replaced by ``_``)."""
    bounds = _check(boundaries, len(layers))
    stages = []
    for a, b in itertools.pairwise(bounds):
        stages.append(nn.Sequential(OrderedDict((n.replace(".", "_"), m) for n, m in layers[a:b])))
    return stages
