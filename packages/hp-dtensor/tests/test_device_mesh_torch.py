"""DeviceMesh next to torch's: meshes bound to torch meshes (``from_group`` subgroups), meta-device
model init, and torch's threaded test process group.

Each behaviour runs on hp and on torch side by side: the same mesh, the same tensor, the same
collective, the values compared with a formula written here.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh
from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
from torch.distributed.tensor import Shard as TorchShard
from torch.distributed.tensor import distribute_tensor as torch_distribute_tensor

from hp_dtensor import DeviceMesh, distribute_tensor
from hp_dtensor import collectives as C
from hp_layout import Mesh, Shard
from hp_testing import run_on_ranks


def _group_count() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def _subgroup_mesh_runs_alone() -> dict[str, object]:
    rank = dist.get_rank()
    halves = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = halves[rank // 2]
    torch_mesh = TorchDeviceMesh.from_group(mine, "cpu")
    before = _group_count()
    mesh = DeviceMesh.from_torch(torch_mesh)
    out: dict[str, object] = {
        "group_is_torchs": mesh.get_group(0) is mine,
        "to_torch_is_torchs": mesh.to_torch() is torch_mesh,
        "lookup_is_bound": DeviceMesh.lookup("cpu", mesh.mesh) is mesh,
        "ranks": mesh.mesh.ranks,
    }
    if rank < 2:
        # Only the first half works; the other half never joins anything. A mesh that created
        # its own groups collectively over the job would wait for it until the timeout.
        full = torch.arange(12.0).reshape(4, 3)
        ours = distribute_tensor(full, mesh, [Shard(0)])
        theirs = torch_distribute_tensor(full, torch_mesh, [TorchShard(0)])
        out["local_equal"] = torch.equal(ours.to_local(), theirs.to_local())
        out["gathered_equal"] = torch.equal(ours.full_tensor(), full)
        summed = C.all_reduce(torch.full((2,), float(rank + 1)), mesh, 0)
        out["summed"] = summed.tolist()
    out["groups_created"] = _group_count() - before
    dist.barrier()
    return out


def test_a_mesh_bound_to_a_from_group_subgroup_needs_no_other_rank() -> None:
    results = run_on_ranks(4, _subgroup_mesh_runs_alone, timeout=60)
    for rank, got in enumerate(results):
        assert got["group_is_torchs"]
        assert got["to_torch_is_torchs"]
        assert got["lookup_is_bound"]
        assert got["ranks"] == ((0, 1) if rank < 2 else (2, 3))
        assert got["groups_created"] == 0
    for got in results[:2]:
        assert got["local_equal"]
        assert got["gathered_equal"]
        assert got["summed"] == [1.0 + 2.0, 1.0 + 2.0]


def _to_torch_under_meta() -> dict[str, object]:
    with torch.device("meta"):
        hp_torch = DeviceMesh("cpu", Mesh((2,), ("meta_x",))).to_torch()
        reference = torch_init_device_mesh("cpu", (2,), mesh_dim_names=("meta_y",))
        weight = torch.empty(4, 3)
    return {
        "hp_grid": hp_torch.mesh.tolist(),
        "hp_grid_device": hp_torch.mesh.device.type,
        "torch_grid": reference.mesh.tolist(),
        "torch_grid_device": reference.mesh.device.type,
        "weight_device": weight.device.type,
    }


def test_to_torch_inside_a_meta_device_context_as_torchs_own_mesh() -> None:
    for got in run_on_ranks(2, _to_torch_under_meta, timeout=60):
        assert got["weight_device"] == "meta"
        assert got["hp_grid"] == got["torch_grid"] == [0, 1]
        assert got["hp_grid_device"] == got["torch_grid_device"] == "cpu"


def _to_torch_of_another_ranks_mesh() -> dict[str, object]:
    """Every rank converts a mesh of rank 1 only (a job whose roles hold different ranks),
    then a mesh of both ranks: the group creations must pair up on both ranks."""
    alone = DeviceMesh("cpu", Mesh((1,), ("only_1",), ranks=(1,))).to_torch()
    both = DeviceMesh("cpu", Mesh((2,), ("after",))).to_torch()
    summed = torch.ones(1)
    dist.all_reduce(summed, group=both.get_group(0))
    return {"coordinate": alone.get_coordinate(), "summed": float(summed)}


def test_to_torch_on_a_rank_outside_the_mesh() -> None:
    """Building a torch mesh is collective over the job, members or not; a rank outside it
    holds none of its groups (no timeout to set) and keeps in step for the next one."""
    got = run_on_ranks(2, _to_torch_of_another_ranks_mesh, timeout=60)
    assert got[0]["coordinate"] is None
    assert list(got[1]["coordinate"]) == [0]  # type: ignore[call-overload]
    assert [g["summed"] for g in got] == [2.0, 2.0]


_THREADED = textwrap.dedent(
    """
    import os, threading
    import torch, torch.distributed as dist
    from torch.testing._internal.distributed.multi_threaded_pg import _install_threaded_pg
    from torch.distributed.device_mesh import init_device_mesh as torch_init_device_mesh
    from hp_dtensor import DeviceMesh, init_device_mesh
    from hp_dtensor import collectives as C

    WORLD = 4
    torch._C._distributed_c10d._set_thread_isolation_mode(True)
    _install_threaded_pg()
    store = dist.HashStore()
    results, errors = {}, []

    def rank_main(rank):
        try:
            dist.init_process_group("threaded", rank=rank, world_size=WORLD, store=store)
            mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("a", "b"))
            along_a = C.all_reduce(torch.tensor([float(rank)]), mesh, "a").item()
            along_b = C.all_reduce(torch.tensor([float(rank)]), mesh, "b").item()
            tm = torch_init_device_mesh("cpu", (2, 2), mesh_dim_names=("ta", "tb"))
            bound = DeviceMesh.from_torch(tm)
            own = DeviceMesh.lookup("cpu", bound.mesh).torch_mesh is tm
            via_torch = C.all_reduce(torch.tensor([float(rank)]), bound, "tb").item()
            results[rank] = (along_a, along_b, own, via_torch)
        except BaseException as exc:
            errors.append((rank, repr(exc)))

    threads = [threading.Thread(target=rank_main, args=(r,), daemon=True) for r in range(WORLD)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(45)
    if errors or any(t.is_alive() for t in threads):
        print("FAILED", errors, [t.is_alive() for t in threads], flush=True)
        os._exit(1)
    print("RESULTS", sorted(results.items()), flush=True)
    """
)


def test_meshes_under_torchs_threaded_process_group() -> None:
    # The threaded process group replaces torch's global world table for the whole process,
    # so it runs in a process of its own.
    done = subprocess.run(
        [sys.executable, "-c", _THREADED], capture_output=True, text=True, timeout=90
    )
    assert done.returncode == 0, done.stdout + done.stderr
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULTS"))
    results = dict(eval(line.removeprefix("RESULTS ")))
    for rank in range(4):
        a, b = divmod(rank, 2)
        # Grid row-major (2, 2): rank = 2a + b. Along "a" the group is {b, 2 + b}; along "b"
        # it is {2a, 2a + 1}.
        assert results[rank] == (2.0 * b + 2.0, 4.0 * a + 1.0, True, 4.0 * a + 1.0)


def _round_trip_of_a_sub_mesh() -> dict[str, object]:
    root = DeviceMesh("cpu", Mesh((2, 1, 2), ("rt_pp", "rt_dp", "rt_tp")))
    stage = root[["rt_dp", "rt_tp"]]
    back = DeviceMesh.from_torch(stage.to_torch())
    # A 2-d mesh over half the job: its group over all its ranks is created from the root,
    # in the same order on every rank (a bound torch sub-mesh has none to give).
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=back.get_mesh_group())
    return {
        "same_mesh": back is stage,
        "unbound": back.torch_mesh is None,
        "lookup": DeviceMesh.lookup("cpu", stage.mesh) is stage,
        "sum": t.item(),
    }


def test_a_torch_mesh_built_by_to_torch_comes_back_as_the_mesh_it_was_built_from() -> None:
    for rank, got in enumerate(run_on_ranks(4, _round_trip_of_a_sub_mesh, timeout=60)):
        assert got["same_mesh"]
        assert got["unbound"]
        assert got["lookup"]
        assert got["sum"] == (0.0 + 1.0 if rank < 2 else 2.0 + 3.0)
