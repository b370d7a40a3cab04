"""Fused communication + matmul for tensor parallelism.

* ``all_gather_matmul(a_shard, b, gather_dim, group)``: ``all_gather(a_shard, gather_dim) @ b``
  (column-parallel input under sequence parallelism);
* ``matmul_reduce_scatter(a, b, scatter_dim, group)``: ``reduce_scatter(a @ b, scatter_dim)``
  (row-parallel output under sequence parallelism).

On CUDA they run PyTorch's symmetric-memory fused ops (``torch.ops.symm_mem``) when symmetric
memory is enabled for the group; on Ascend NPU, ``torch_npu``'s fused mc2 ops for the 2-D,
gather/scatter-on-rows, fp16/bf16 case they support; everywhere else (and for everything
those do not cover) the reference: the collective through ``torch.distributed``'s functional
collectives (gloo on CPU), then or before one matmul. Shards must be equal in size (the
collectives require it); errors say so.

Registered as ``torch.ops.hp_kernels.all_gather_matmul`` / ``matmul_reduce_scatter`` with fake
implementations (shapes from the group's size).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _resolve_process_group
from torch.distributed.distributed_c10d import GroupName
from torch.distributed.distributed_c10d import _get_group_size_by_name as _group_size_of

import hp_kernels.reference as reference
from hp_kernels.backends import force_reference, torch_npu_missing, warn_fallback

__all__ = ["all_gather_matmul", "matmul_reduce_scatter"]


def _world(group_name: str) -> int:
    return _group_size_of(GroupName(group_name))


def _symm_mem_enabled(group_name: str) -> bool:
    try:
        from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    except ImportError:
        return False
    return bool(is_symm_mem_enabled_for_group(GroupName(group_name)))


def _hccl_name(group_name: str) -> str:
    group = _resolve_process_group(GroupName(group_name))
    rank = dist.get_rank(group)
    backend = group._get_backend(torch.device("npu"))
    name: str = backend.get_hccl_comm_name(rank)  # type: ignore[attr-defined]
    return name


def _npu_mc2_fits(a: torch.Tensor, b: torch.Tensor, dim: int) -> bool:
    # What the mc2 ops accept (torch_npu docs): 2-D operands, rows gathered/scattered,
    # fp16/bf16, k in [256, 65535).
    return (
        a.dim() == 2
        and b.dim() == 2
        and dim == 0
        and a.dtype in (torch.float16, torch.bfloat16)
        and b.dtype == a.dtype
        and 256 <= a.size(1) < 65535
    )


def _ag_native(
    a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_name: str
) -> Callable[[], torch.Tensor] | None:
    op = "all_gather_matmul"
    device_type = a_shard.device.type
    if force_reference():
        return None
    if device_type == "cuda":
        if not _symm_mem_enabled(group_name):
            warn_fallback(op, device_type, "symmetric memory is not enabled for the group")
            return None

        def cuda() -> torch.Tensor:
            _, outs = torch.ops.symm_mem.fused_all_gather_matmul(
                a_shard, [b], gather_dim, group_name, return_A=False
            )
            out: torch.Tensor = outs[0]
            return out

        return cuda
    if device_type == "npu":
        why = torch_npu_missing()
        if why is not None or not _npu_mc2_fits(a_shard, b, gather_dim):
            warn_fallback(
                op, device_type, why or "shapes/dtypes outside what torch_npu's mc2 op takes"
            )
            return None

        def npu() -> torch.Tensor:
            import torch_npu

            world = _world(group_name)
            out, _ = torch_npu.npu_all_gather_base_mm(
                a_shard, b, _hccl_name(group_name), world, gather_output=False
            )
            return out  # type: ignore[no-any-return]

        return npu
    # Elsewhere (CPU/gloo) the decomposed op is the implementation, not a fallback: no log.
    return None


def _rs_native(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> Callable[[], torch.Tensor] | None:
    op = "matmul_reduce_scatter"
    device_type = a.device.type
    if force_reference():
        return None
    if device_type == "cuda":
        if not _symm_mem_enabled(group_name):
            warn_fallback(op, device_type, "symmetric memory is not enabled for the group")
            return None

        def cuda() -> torch.Tensor:
            out: torch.Tensor = torch.ops.symm_mem.fused_matmul_reduce_scatter(
                a, b, reduce_op, scatter_dim, group_name
            )
            return out

        return cuda
    if device_type == "npu":
        why = torch_npu_missing()
        if why is not None or reduce_op != "sum" or not _npu_mc2_fits(a, b, scatter_dim):
            warn_fallback(
                op, device_type, why or "shapes/dtypes outside what torch_npu's mc2 op takes"
            )
            return None

        def npu() -> torch.Tensor:
            import torch_npu

            world = _world(group_name)
            out = torch_npu.npu_mm_reduce_scatter_base(
                a, b, _hccl_name(group_name), world, reduce_op="sum"
            )
            return out  # type: ignore[no-any-return]

        return npu
    # Elsewhere (CPU/gloo) the decomposed op is the implementation, not a fallback: no log.
    return None


def _norm_dim(op: str, dim: int, ndim: int, what: str) -> int:
    if not -ndim <= dim < ndim:
        raise ValueError(f"hp_kernels.{op}: {what} {dim} is out of range for {ndim}-D input")
    return dim % ndim


def _ag_shape(a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, world: int) -> list[int]:
    if b.dim() != 2 or a_shard.dim() < 2 or a_shard.size(-1) != b.size(0):
        raise ValueError(
            f"hp_kernels.all_gather_matmul: a_shard {tuple(a_shard.shape)} @ b {tuple(b.shape)}: "
            "a_shard must be [..., k] with at least 2 dims and b a 2-D [k, n]"
        )
    dim = _norm_dim("all_gather_matmul", gather_dim, a_shard.dim(), "gather_dim")
    if dim == a_shard.dim() - 1:
        raise ValueError(
            "hp_kernels.all_gather_matmul: gather_dim is the contraction dim k; gather a "
            f"row dim (0..{a_shard.dim() - 2}) instead"
        )
    shape = list(a_shard.shape)
    shape[dim] *= world
    shape[-1] = b.size(1)
    return shape


def _rs_shape(a: torch.Tensor, b: torch.Tensor, scatter_dim: int, world: int) -> list[int]:
    if b.dim() != 2 or a.dim() < 2 or a.size(-1) != b.size(0):
        raise ValueError(
            f"hp_kernels.matmul_reduce_scatter: a {tuple(a.shape)} @ b {tuple(b.shape)}: a must "
            "be [..., k] with at least 2 dims and b a 2-D [k, n]"
        )
    shape = [*a.shape[:-1], b.size(1)]
    dim = _norm_dim("matmul_reduce_scatter", scatter_dim, len(shape), "scatter_dim")
    if shape[dim] % world:
        raise ValueError(
            f"hp_kernels.matmul_reduce_scatter: output dim {dim} has size {shape[dim]}, not "
            f"divisible by the group size {world}; pad it to a multiple of {world}"
        )
    shape[dim] //= world
    return shape


@torch.library.custom_op("hp_kernels::all_gather_matmul", mutates_args=())
def _all_gather_matmul_op(
    a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_name: str
) -> torch.Tensor:
    _ag_shape(a_shard, b, gather_dim, _world(group_name))
    gather_dim %= a_shard.dim()
    native = _ag_native(a_shard, b, gather_dim, group_name)
    if native is not None:
        return native()
    return reference.all_gather_matmul(a_shard, b, gather_dim, group_name)


@_all_gather_matmul_op.register_fake
def _all_gather_matmul_fake(
    a_shard: torch.Tensor, b: torch.Tensor, gather_dim: int, group_name: str
) -> torch.Tensor:
    shape = _ag_shape(a_shard, b, gather_dim, _world(group_name))
    return a_shard.new_empty(shape, dtype=torch.promote_types(a_shard.dtype, b.dtype))


@torch.library.custom_op("hp_kernels::matmul_reduce_scatter", mutates_args=())
def _matmul_reduce_scatter_op(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> torch.Tensor:
    shape = _rs_shape(a, b, scatter_dim, _world(group_name))
    scatter_dim %= len(shape)
    native = _rs_native(a, b, scatter_dim, reduce_op, group_name)
    if native is not None:
        return native()
    return reference.matmul_reduce_scatter(a, b, scatter_dim, reduce_op, group_name)


@_matmul_reduce_scatter_op.register_fake
def _matmul_reduce_scatter_fake(
    a: torch.Tensor, b: torch.Tensor, scatter_dim: int, reduce_op: str, group_name: str
) -> torch.Tensor:
    shape = _rs_shape(a, b, scatter_dim, _world(group_name))
    return a.new_empty(shape, dtype=torch.promote_types(a.dtype, b.dtype))


def _group_name(group: dist.ProcessGroup | None) -> str:
    pg = group if group is not None else dist.group.WORLD
    if pg is None:
        raise RuntimeError(
            "hp_kernels: no process group given and torch.distributed is not initialized"
        )
    return str(pg.group_name)


def all_gather_matmul(
    a_shard: torch.Tensor,
    b: torch.Tensor,
    gather_dim: int = 0,
    group: dist.ProcessGroup | None = None,
) -> torch.Tensor:
    """``all_gather(a_shard, dim=gather_dim) @ b`` over ``group`` (default: the world).

    ``a_shard`` is ``[..., k]`` (this rank's equal-sized shard along ``gather_dim``, a row
    dim), ``b`` is ``[k, n]``; the result is the full ``[..., n]`` on every rank.
    """
    out: torch.Tensor = torch.ops.hp_kernels.all_gather_matmul(
        a_shard, b, gather_dim, _group_name(group)
    )
    return out


def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int = 0,
    group: dist.ProcessGroup | None = None,
    reduce_op: str = "sum",
) -> torch.Tensor:
    """``reduce_scatter(a @ b, reduce_op, dim=scatter_dim)`` over ``group`` (default: world).

    ``a`` is ``[..., k]`` (this rank's partial operand), ``b`` is ``[k, n]``; the product's
    ``scatter_dim`` must divide by the group size, and each rank gets its equal chunk of the
    reduced product.
    """
    out: torch.Tensor = torch.ops.hp_kernels.matmul_reduce_scatter(
        a, b, scatter_dim, reduce_op, _group_name(group)
    )
    return out
