"""DeviceMesh: an ``hp_layout.Mesh`` bound to ``torch.distributed`` process groups.

Process groups are created lazily, the first time a group along an axis is needed, and then
reused: one process group per rank list, shared by every mesh that has that group. Creation is
collective over the whole job, as for torch's DeviceMesh: all groups along the axis of the
*root* mesh (the mesh a sub-mesh was cut from) are created at once, in the same order on every
rank, so every rank must reach its first use of an axis (SPMD code does). Group ranks follow
the mesh's coordinate order (``sort_ranks=False``), so collectives return pieces in coordinate
order. Every group gets the job's timeout (:func:`hp_dtensor.watchdog.group_timeout`: the one
given to :func:`init_device_mesh`, else the default group's), not torch's 30-minute default for
new groups.

A mesh made from a torch ``DeviceMesh`` (:meth:`DeviceMesh.from_torch`) is *bound* to it instead:
its groups are the torch mesh's own (never created here), so a mesh over a subgroup
(``torch.distributed.device_mesh.DeviceMesh.from_group``) works without the rest of the job.

Everything remembered about process groups is kept per default group: under torch's threaded
test process group the ranks are threads of one process, each with its own default group, and a
table shared by the threads would hand one rank another's groups.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

import hp_dtensor.watchdog as watchdog
from hp_dtensor.device import backend_for, local_device, prepare_device_type
from hp_layout import Mesh

__all__ = ["DeviceMesh", "forget_groups", "init_device_mesh"]

# The DeviceMesh to use for a (device type, mesh) when no bound one is known: see
# DeviceMesh.lookup. Meshes not bound to torch ones look their groups up per world, so sharing
# them between threads is safe.
_KNOWN: dict[tuple[str, Mesh], DeviceMesh] = {}
# How many default groups' tables are kept (a threaded test runs one per rank thread).
_MAX_WORLDS = 64


class _World:
    """What one default group (one job, or one rank thread under torch's threaded process group)
    has: the groups created in it by rank list (None where this rank is not a member; all ranks
    create the same groups in the same order, so these tables agree across ranks), the torch
    meshes built by :meth:`DeviceMesh.to_torch`, and the meshes bound to torch ones."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.created: dict[tuple[int, ...], dist.ProcessGroup | None] = {}
        self.torch_meshes: dict[DeviceMesh, Any] = {}
        self.bound: dict[tuple[str, Mesh], DeviceMesh] = {}


# By id of the default group; each entry holds its group, so an id is never reused while kept.
_WORLDS: dict[int, _World] = {}


def _world() -> _World:
    group = _default_group()
    found = _WORLDS.get(id(group))
    if found is None or found.group is not group:
        while len(_WORLDS) >= _MAX_WORLDS:
            del _WORLDS[next(iter(_WORLDS))]
        found = _World(group)
        _WORLDS[id(group)] = found
    return found


def forget_groups() -> None:
    """Drop every reference this package keeps to the job's process groups: the groups created
    per default group, the torch meshes built over them, the meshes bound to torch ones, the
    known meshes and the watchdog's counts. Call it after
    ``torch.distributed.destroy_process_group``: torch frees a group's backend only with its
    last reference, and gloo's backend joins its worker threads then, which must happen while
    the interpreter still runs (see :func:`hp_dtensor.watchdog.forget_groups`). Meshes held
    elsewhere stay usable in a later job: they look their groups up per default group."""
    _WORLDS.clear()
    _KNOWN.clear()
    watchdog.forget_groups()


def _default_group() -> dist.ProcessGroup:
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group "
            "(or launch with torchrun and use init_device_mesh) first"
        )
    group = dist.group.WORLD
    assert group is not None
    return group


def ensure_groups(groups: Sequence[Sequence[int]], name: str | None = None) -> None:
    """Create every group in ``groups`` that does not exist yet, collectively, with the job's
    timeout; ``name`` (a mesh axis) names them in timeout errors.

    Every rank of the job must call this with the same ``groups`` in the same order.
    """
    world = _world()
    world_ranks = tuple(range(dist.get_world_size()))
    me = dist.get_rank()
    timeout = watchdog.group_timeout()
    for ranks in groups:
        key = tuple(ranks)
        if name is not None:
            watchdog.name_group(key, name)
        if key in world.created:
            continue
        if key == world_ranks:
            world.created[key] = world.group
            continue
        created = dist.new_group(
            list(key),
            sort_ranks=False,
            timeout=timeout,
            group_desc=f"hp_{name}" if name is not None else None,
        )
        world.created[key] = (
            created if me in key and isinstance(created, dist.ProcessGroup) else None
        )


def process_group(ranks: Sequence[int]) -> dist.ProcessGroup:
    """The existing process group over ``ranks`` (its rank ``i`` is ``ranks[i]``)."""
    group = _world().created.get(tuple(ranks))
    if group is None:
        raise RuntimeError(
            f"no process group over ranks {list(ranks)} on rank {dist.get_rank()}: create it "
            "with ensure_groups (collectively) first"
        )
    return group


class DeviceMesh:
    """A mesh of ranks for one device type, with its process groups.

    Args:
        device_type: ``"cpu"``, ``"cuda"`` or ``"npu"``.
        mesh: the rank grid and axis names.

    The mesh may be built on every rank of the job or only on the ranks it contains; methods
    that need this rank's position raise if the rank is not in the mesh. A mesh made by
    :meth:`from_torch` uses the torch mesh's process groups instead of creating its own.
    """

    def __init__(self, device_type: str, mesh: Mesh, *, root: Mesh | None = None) -> None:
        self.device_type = prepare_device_type(device_type)
        if not isinstance(mesh, Mesh):
            raise TypeError(f"DeviceMesh needs an hp_layout.Mesh, got {type(mesh).__name__}")
        self.mesh = mesh
        # Groups are created for the root mesh's axes, so that every rank creates the same
        # groups whichever sub-mesh it holds.
        self._root = mesh if root is None else root
        self._torch_mesh: Any = None
        known = _KNOWN.get((self.device_type, mesh))
        if known is None or known._root.size < self._root.size:
            _KNOWN[(self.device_type, mesh)] = self

    @classmethod
    def lookup(cls, device_type: str, mesh: Mesh) -> DeviceMesh:
        """The DeviceMesh already built for ``mesh``: one bound to a torch mesh in this job
        (whose groups the tensors' collectives must use), else the one cut from the largest
        root, else a new one. Code that only has a layout's mesh uses this, so process groups
        are those of the mesh the tensors live on."""
        if dist.is_initialized():
            bound = _world().bound.get((device_type, mesh))
            if bound is not None:
                return bound
        known = _KNOWN.get((device_type, mesh))
        return known if known is not None else cls(device_type, mesh)

    # Value semantics -------------------------------------------------------------------------

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, DeviceMesh):
            return NotImplemented
        return self.device_type == other.device_type and self.mesh == other.mesh

    def __hash__(self) -> int:
        return hash((self.device_type, self.mesh))

    def __repr__(self) -> str:
        return f"DeviceMesh({self.device_type!r}, {self.mesh!r})"

    # Shape -----------------------------------------------------------------------------------

    @property
    def shape(self) -> tuple[int, ...]:
        """Size of each axis."""
        return self.mesh.shape

    @property
    def ndim(self) -> int:
        """Number of axes."""
        return self.mesh.ndim

    @property
    def mesh_dim_names(self) -> tuple[str, ...]:
        """Axis names (``torch.distributed.device_mesh`` calls them mesh dim names)."""
        return self.mesh.axis_names

    def size(self, axis: str | int | None = None) -> int:
        """Number of ranks in the mesh, or along ``axis``."""
        return self.mesh.size if axis is None else self.mesh.axis_size(axis)

    @property
    def device(self) -> torch.device:
        """The device this process computes on."""
        return local_device(self.device_type)

    # This rank -------------------------------------------------------------------------------

    def get_rank(self) -> int:
        """This process's (under torch's threaded process group, this thread's) global rank."""
        world = _default_group()
        cached = self.__dict__.get("_rank")
        if cached is not None and cached[0] is world:
            return int(cached[1])
        rank = dist.get_rank()
        self.__dict__["_rank"] = (world, rank)
        return rank

    def get_coordinate(self) -> tuple[int, ...] | None:
        """This rank's coordinate in the mesh, or None if it is not in the mesh."""
        rank = self.get_rank()
        return self.mesh.coordinate(rank) if rank in self.mesh else None

    def _coordinate(self) -> tuple[int, ...]:
        coordinate = self.get_coordinate()
        if coordinate is None:
            raise RuntimeError(f"rank {self.get_rank()} is not in {self!r}")
        return coordinate

    def get_local_rank(self, axis: str | int) -> int:
        """This rank's coordinate along ``axis``."""
        return self._coordinate()[self.mesh.axis_index(axis)]

    def group_ranks(self, axis: str | int) -> tuple[int, ...]:
        """Global ranks of this rank's group along ``axis``, in coordinate order."""
        self._coordinate()
        return self.mesh.group_of(self.get_rank(), axis)

    def get_group(self, axis: str | int = 0) -> dist.ProcessGroup:
        """This rank's process group along ``axis``: the torch mesh's for a bound mesh, else
        created on first use, then reused.

        The first use of an axis of an unbound mesh creates the groups of every rank along it,
        collectively: all ranks of the job must reach it.
        """
        if self._torch_mesh is not None:
            group: dist.ProcessGroup = self._torch_mesh.get_group(self.mesh.axis_index(axis))
            return group
        ranks = self.group_ranks(axis)
        if tuple(ranks) not in _world().created:
            name = self.mesh.axis_names[self.mesh.axis_index(axis)]
            ensure_groups(self._root.groups(name), name)
        return process_group(ranks)

    def axis_group(self, axis: str | int, build: Any) -> Any:
        """This rank's ``build(process_group, size, coordinate)`` along ``axis``, built once
        per axis and world (collectives look their group up on every call)."""
        world = _default_group()
        cache = self.__dict__.setdefault("_axis_groups", {})
        key = (id(world), axis)
        found = cache.get(key)
        if found is None or found[0] is not world:
            built = build(self.get_group(axis), self.size(axis), self.get_local_rank(axis))
            found = (world, built)
            cache[key] = found
        return found[1]

    def get_mesh_group(self) -> dist.ProcessGroup:
        """The process group over all ranks of this mesh (created collectively on first use).

        Raises:
            NotImplementedError: a bound mesh of several axes over part of the job (torch's
                mesh has no group over all its ranks; flatten it and bind the 1-d mesh).
        """
        self._coordinate()
        ranks = self.mesh.ranks
        if self._torch_mesh is not None:
            if self.ndim == 1:
                return self.get_group(0)
            if sorted(ranks) == list(range(dist.get_world_size())):
                return _default_group()
            raise NotImplementedError(
                f"no process group over all ranks of {self!r}, a {self.ndim}-d mesh bound to a "
                "torch mesh over part of the job; flatten the torch mesh and bind the 1-d mesh"
            )
        if tuple(ranks) not in _world().created:
            ensure_groups(self._root.groups(self.mesh.axis_names), "x".join(self.mesh.axis_names))
        return process_group(ranks)

    def __getitem__(self, axes: str | Sequence[str]) -> DeviceMesh:
        """The sub-mesh over ``axes`` that contains this rank (bound to the torch mesh's
        sub-mesh for a bound mesh)."""
        names = [axes] if isinstance(axes, str) else list(axes)
        self._coordinate()
        if self._torch_mesh is not None:
            if tuple(names) == self.mesh.axis_names:
                return self
            torch_names = self._torch_mesh.mesh_dim_names
            if torch_names is None:
                raise ValueError(
                    f"cannot slice axes {names} of {self!r}: its torch mesh has no dimension "
                    "names; give the torch mesh mesh_dim_names"
                )
            positions = [self.mesh.axis_index(n) for n in names]
            return DeviceMesh.from_torch(self._torch_mesh[tuple(torch_names[i] for i in positions)])
        return DeviceMesh(
            self.device_type, self.mesh.submesh(names, self.get_rank()), root=self._root
        )

    # Interop ---------------------------------------------------------------------------------

    @classmethod
    def from_torch(cls, torch_mesh: Any) -> DeviceMesh:
        """The mesh of a ``torch.distributed.device_mesh.DeviceMesh`` (same device type, ranks
        and axis names; unnamed axes are called ``dim0``, ``dim1``, ...), bound to it: its
        process groups are the torch mesh's own and :meth:`to_torch` returns ``torch_mesh``
        itself. Nothing collective happens, so a mesh over a subgroup needs no other rank.
        Later :meth:`lookup` calls for the same rank grid in this job return the bound mesh.

        A torch mesh that :meth:`to_torch` built gives back the mesh it was built from (a
        round trip through torch, e.g. a torch DTensor of a mesh cut from a larger hp mesh,
        keeps that mesh's root and group creation)."""
        world = _world()
        for built_from, built in world.torch_meshes.items():
            if built is torch_mesh:
                return built_from
        grid = torch_mesh.mesh
        names = torch_mesh.mesh_dim_names or tuple(f"dim{i}" for i in range(grid.ndim))
        mesh = Mesh(tuple(grid.shape), tuple(names), [int(r) for r in grid.flatten().tolist()])
        device_type = prepare_device_type(torch_mesh.device_type)
        found = world.bound.get((device_type, mesh))
        if found is not None and found._torch_mesh is torch_mesh:
            return found
        bound = cls.__new__(cls)
        bound.device_type = device_type
        bound.mesh = mesh
        bound._root = mesh
        bound._torch_mesh = torch_mesh
        world.bound[(device_type, mesh)] = bound
        return bound

    @property
    def torch_mesh(self) -> Any:
        """The torch mesh this mesh is bound to (:meth:`from_torch`), or None."""
        return self._torch_mesh

    def to_torch(self) -> Any:
        """The equivalent ``torch.distributed.device_mesh.DeviceMesh``: the one a bound mesh
        was made from, else one built once per mesh and world (building one is collective over
        the job, like torch's own)."""
        if self._torch_mesh is not None:
            return self._torch_mesh
        world = _world()
        cached = world.torch_meshes.get(self)
        if cached is not None:
            return cached
        from torch.distributed.device_mesh import DeviceMesh as TorchDeviceMesh

        root = self._root
        names = self.mesh.axis_names
        if root != self.mesh and self._is_slice_of_root():
            # A sub-mesh (e.g. one pipeline stage's ranks): ranks of other sub-meshes convert
            # theirs at the same point, and torch creates groups collectively over the job, so
            # each rank building only its own sub-mesh would pair mismatched group creations.
            # Every rank builds the root instead (the same collective sequence) and slices it.
            root_mesh = DeviceMesh(self.device_type, root).to_torch()
            torch_mesh = root_mesh[names]
        else:
            # The grid is host data; under ``with torch.device("meta")`` (meta-device model
            # init) a grid made on the default device could not be read back.
            grid = torch.tensor(self.mesh.ranks, dtype=torch.int, device="cpu")
            with torch.device("cpu"):
                torch_mesh = TorchDeviceMesh(
                    self.device_type, grid.reshape(self.mesh.shape), mesh_dim_names=names
                )
            _apply_timeout(torch_mesh)
        world.torch_meshes[self] = torch_mesh
        return torch_mesh

    def _is_slice_of_root(self) -> bool:
        """Whether this mesh is the root's sub-mesh over some of its axes through this rank."""
        names = self.mesh.axis_names
        if not set(names) <= set(self._root.axis_names) or self.get_rank() not in self.mesh:
            return False
        return self._root.submesh(list(names), self.get_rank()) == self.mesh


def _apply_timeout(torch_mesh: Any) -> None:
    """Give the groups torch's DeviceMesh created the job's timeout (torch gives new groups its
    30-minute default); the default group keeps its own."""
    timeout = watchdog.group_timeout()
    set_timeout = getattr(dist.distributed_c10d, "_set_pg_timeout", None)
    # A rank outside the mesh (which still takes part in building it) holds none of its groups.
    if timeout is None or set_timeout is None or torch_mesh.get_coordinate() is None:
        return
    for dim in range(torch_mesh.ndim):
        group = torch_mesh.get_group(dim)
        if group is not dist.group.WORLD:
            set_timeout(timeout, group)


def init_device_mesh(
    device_type: str,
    mesh_shape: Sequence[int],
    *,
    mesh_dim_names: Sequence[str] | None = None,
    timeout_s: float | None = None,
) -> DeviceMesh:
    """Initialize ``torch.distributed`` if needed and return a mesh over all ranks.

    The grid is ``range(world_size)`` reshaped row-major, so the last axis holds consecutive
    ranks (the fast tier under ``hp_layout.Topology.from_env``). Reads torchrun's environment
    (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``).

    ``timeout_s``: the job's collective timeout, for the default group (when this call creates
    it) and every group the mesh creates; it also turns the watchdog on
    (:func:`hp_dtensor.watchdog.configure`), so a collective that a rank never joins raises
    :class:`~hp_dtensor.watchdog.CollectiveTimeoutError` naming that rank.
    """
    backend = backend_for(device_type)
    if timeout_s is not None:
        watchdog.configure(timeout_s)
    if not dist.is_initialized():
        kwargs: dict[str, Any] = {"backend": backend}
        if timeout_s is not None:
            from datetime import timedelta

            kwargs["timeout"] = timedelta(seconds=timeout_s)
        if device_type != "cpu":
            torch.accelerator.set_device_index(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group(**kwargs)
    shape = tuple(mesh_shape)
    world = dist.get_world_size()
    if math.prod(shape) != world:
        raise ValueError(
            f"mesh shape {shape} holds {math.prod(shape)} ranks but the job has {world}"
        )
    names = (
        tuple(mesh_dim_names)
        if mesh_dim_names is not None
        else tuple(f"dim{i}" for i in range(len(shape)))
    )
    return DeviceMesh(device_type, Mesh(shape, names))
