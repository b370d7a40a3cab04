"""Helpers for use inside rank functions (code that runs in a :class:`RankPool` worker)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

__all__ = ["assert_all_ranks_equal", "rank", "world_size"]


def _require_initialized(what: str) -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(
            f"hp_testing.{what}() needs an initialized torch.distributed default process "
            "group: call it inside a function run by RankPool.run / run_on_ranks, or inside "
            "fake_world()"
        )


def rank() -> int:
    """This process's rank in the default process group."""
    _require_initialized("rank")
    return dist.get_rank()


def world_size() -> int:
    """The number of ranks in the default process group."""
    _require_initialized("world_size")
    return dist.get_world_size()


@functools.cache
def _dtype_table() -> list[torch.dtype]:
    """Every torch dtype, in a fixed order (the same on every rank)."""
    found = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
    return [found[name] for name in sorted(found)]


def _all_gather(
    tensor: torch.Tensor, size: int, group: dist.ProcessGroup | None
) -> list[torch.Tensor]:
    out = [torch.empty_like(tensor) for _ in range(size)]
    dist.all_gather(out, tensor, group=group)
    return out


def _differs(a: torch.Tensor, b: torch.Tensor, rtol: float, atol: float) -> torch.Tensor:
    """Elementwise 'not equal' mask (NaN equals NaN) of two same-shape, same-dtype tensors."""
    if a.is_floating_point() or a.is_complex():
        return ~torch.isclose(a, b, rtol=rtol, atol=atol, equal_nan=True)
    return a != b


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0 or a.dtype == torch.bool:
        return float("nan")
    wide = torch.complex128 if a.is_complex() else torch.float64
    diff = (a.to(wide) - b.to(wide)).abs()
    return float(diff.nan_to_num(nan=0.0).max())


def _assert_same_shape_and_dtype(
    local: torch.Tensor,
    size: int,
    group: dist.ProcessGroup | None,
    global_ranks: list[int],
    prefix: str,
) -> None:
    """Raise (on every rank alike) if the ranks' tensors differ in shape or dtype, naming
    which ranks have which. Plain tensor collectives: all_gather_object needs numpy."""
    table = _dtype_table()
    header = torch.tensor([local.dim(), table.index(local.dtype)], dtype=torch.int64)
    headers = _all_gather(header, size, group)
    padded = torch.full((max(1, *(int(h[0]) for h in headers)),), -1, dtype=torch.int64)
    padded[: local.dim()] = torch.tensor(local.shape, dtype=torch.int64)
    dims = _all_gather(padded, size, group)
    kinds: dict[tuple[tuple[int, ...], torch.dtype], list[int]] = {}
    for global_rank, dim, head in zip(global_ranks, dims, headers, strict=True):
        shape = tuple(int(d) for d in dim[: int(head[0])])
        kinds.setdefault((shape, table[int(head[1])]), []).append(global_rank)
    if len(kinds) > 1:
        listing = "; ".join(
            f"rank(s) {members}: shape {list(shape)} dtype {dtype}"
            for (shape, dtype), members in kinds.items()
        )
        raise AssertionError(f"{prefix}tensor shape/dtype differs across ranks: {listing}")


def assert_all_ranks_equal(
    tensor: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    rtol: float = 0.0,
    atol: float = 0.0,
    msg: str = "",
) -> None:
    """Assert that ``tensor`` is the same on every rank of ``group`` (default: all ranks).

    A collective: every rank of the group must call it. The tensor is copied to CPU and
    gathered with ``all_gather`` (the group must handle CPU tensors, as gloo does); shapes
    and dtypes are compared first, so unequal shapes fail cleanly instead of hanging. Values
    are compared exactly by default (NaN equals NaN); pass ``rtol``/``atol`` to allow
    rounding. On a mismatch every rank raises the same ``AssertionError``, which names the
    ranks that differ from the majority (ties: from the lowest rank).
    """
    _require_initialized("assert_all_ranks_equal")
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"assert_all_ranks_equal expects a tensor, got {type(tensor).__name__}")
    if tensor.device.type == "meta":
        raise TypeError("assert_all_ranks_equal cannot compare meta tensors (they hold no data)")
    local = tensor.detach().to("cpu").contiguous()
    ranks = dist.get_process_group_ranks(group) if group is not None else None
    size = dist.get_world_size(group)
    global_ranks = ranks if ranks is not None else list(range(size))
    prefix = f"{msg}: " if msg else ""

    # Shapes and dtypes first, so that unequal shapes fail cleanly instead of hanging.
    _assert_same_shape_and_dtype(local, size, group, global_ranks, prefix)

    wire = local.to(torch.uint8) if local.dtype == torch.bool else local
    gathered = [torch.empty_like(wire) for _ in range(size)]
    dist.all_gather(gathered, wire, group=group)
    if local.dtype == torch.bool:
        gathered = [t.to(torch.bool) for t in gathered]

    # Equivalence classes of equal tensors, in rank order; the biggest class is "the value".
    classes: list[list[int]] = []
    for i, value in enumerate(gathered):
        for members in classes:
            if not bool(_differs(gathered[members[0]], value, rtol, atol).any()):
                members.append(i)
                break
        else:
            classes.append([i])
    if len(classes) == 1:
        return
    majority = max(classes, key=len)
    ref = gathered[majority[0]]
    details = []
    for members in classes:
        if members is majority:
            continue
        for i in members:
            mask = _differs(ref, gathered[i], rtol, atol)
            details.append(
                f"rank {global_ranks[i]}: {int(mask.sum())} of {mask.numel()} element(s) "
                f"differ, max |difference| {_max_abs_diff(ref, gathered[i]):.6g}"
            )
    odd = sorted(global_ranks[i] for members in classes if members is not majority for i in members)
    raise AssertionError(
        f"{prefix}tensor differs across ranks: rank(s) {odd} differ from rank(s) "
        f"{[global_ranks[i] for i in majority]} (rtol={rtol:g}, atol={atol:g}); "
        + "; ".join(details)
    )
