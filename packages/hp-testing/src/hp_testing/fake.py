"""A fake ``torch.distributed`` world in this process, for large world sizes without processes."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch.distributed as dist

# Store/HashStore are public as torch.distributed.*, but torch's stubs only export them here.
from torch._C._distributed_c10d import HashStore, Store

__all__ = ["fake_world"]


def _fake_store() -> Store:
    try:  # what torch's own tests use; a private module, so fall back to a plain HashStore
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError:
        return HashStore()
    return FakeStore()


@contextmanager
def fake_world(
    world_size: int, rank: int = 0, *, timeout: float = 60.0
) -> Iterator[dist.ProcessGroup]:
    """Pretend to be ``rank`` of ``world_size`` ranks, in this process, with no other process.

    Initializes the default ``torch.distributed`` process group with torch's ``"fake"``
    backend (a ``FakeProcessGroup`` over a ``FakeStore``), yields it, and destroys the default
    group on exit, also when the body raises.

    The fake backend moves no data: every collective returns at once, successfully, and
    leaves its output buffers as they were (an ``all_reduce`` does not sum, an
    ``all_gather`` does not fill). What it is good for is everything around the data: device
    meshes and their sub-groups (``init_device_mesh("cpu", (8, 96))`` at world size 768),
    group membership and rank arithmetic, shape propagation, and tracing collectives on
    ``meta`` tensors (which allocate nothing), so code paths at 64 to 768 ranks run in
    milliseconds. Never check numerical results under it.

    Raises:
        ValueError: ``world_size`` < 1 or ``rank`` outside ``range(world_size)``.
        RuntimeError: a default process group is already initialized in this process
            (``fake_world`` does not nest, and does not replace a real group).
    """
    for name, value in (("world_size", world_size), ("rank", rank)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"fake_world: {name} must be an int, got {value!r}")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(
            f"fake_world: need world_size >= 1 and 0 <= rank < world_size, "
            f"got world_size={world_size}, rank={rank}"
        )
    if not dist.is_available():
        raise RuntimeError("fake_world: this torch build has no torch.distributed")
    if dist.is_initialized():
        raise RuntimeError(
            "fake_world: a default torch.distributed process group is already initialized in "
            f"this process (backend {dist.get_backend()!r}, world size "
            f"{dist.get_world_size()}); fake_world cannot nest or replace it. Leave the "
            "enclosing fake_world, or call torch.distributed.destroy_process_group(), first"
        )
    dist.init_process_group(
        backend="fake",
        store=_fake_store(),
        rank=rank,
        world_size=world_size,
        timeout=timedelta(seconds=timeout),
    )
    try:
        group = dist.group.WORLD
        if group is None:  # pragma: no cover - init_process_group just set it
            raise RuntimeError("fake_world: no default process group after initialization")
        yield group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
