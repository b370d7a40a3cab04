"""TensorPool / RemoteTensor: host and peer placements, the bounded cache, usage and errors."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
import torch.distributed as dist

from hp_offload.pool import TensorPool
from hp_offload.remote import Host, Peer, Placement, PoolUsage
from hp_testing import run_on_ranks

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.complex64,
)
_SHAPES: tuple[tuple[int, ...], ...] = ((), (0,), (3, 0, 2), (7,), (5, 3), (2, 3, 4))


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().contiguous().reshape(-1).view(torch.uint8).tolist())


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-equal, with dtype and shape (NaNs included)."""
    return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)


def _random(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    raw = torch.randint(
        0, 256, (max(1, torch.Size(shape).numel() * dtype.itemsize),), generator=gen
    )
    data = raw.to(torch.uint8)[: torch.Size(shape).numel() * dtype.itemsize]
    if dtype == torch.bool:
        data = data % 2
    return data.view(dtype).reshape(shape).clone()


def _cases(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cases = {
        f"t{i}_{j}": _random(shape, dtype, gen)
        for i, dtype in enumerate(_DTYPES)
        for j, shape in enumerate(_SHAPES)
    }
    cases["strided"] = torch.arange(12.0).reshape(3, 4).t()  # non-contiguous input
    cases["nan"] = torch.tensor([float("nan"), -0.0, float("inf")])
    return cases


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


# ------------------------------------------------------------------------- single process


def test_host_round_trip_and_usage() -> None:
    cases = _cases(0)
    pool = TensorPool(cache_bytes=1 << 16)
    for name, t in cases.items():
        handle = pool.put(name, t)
        assert handle.placement == Host()
        assert handle.nbytes == _nbytes(t)
    originals = {n: t.clone() for n, t in cases.items()}
    for t in cases.values():  # the pool holds copies
        if t.numel() and t.dtype != torch.bool:
            t.zero_()
    for name, t in originals.items():
        assert _same(pool.get(name), t), name
    usage = pool.usage()
    total = sum(_nbytes(t) for t in originals.values())
    assert usage.held_bytes == {"host": total}
    assert usage.cache_bytes == total
    assert usage.cache_entries == len(originals)
    assert (usage.hits, usage.misses, usage.transfers) == (0, len(originals), len(originals))
    assert usage.bytes_transferred == total
    assert usage.staged_bytes == 0
    assert usage.hosted_bytes == {}


def test_counts_prefetch_log_and_eviction() -> None:
    pool = TensorPool(cache_bytes=100)
    a = pool.put("a", torch.ones(10))  # 40 bytes
    pool.put("b", torch.ones(10))
    pool.put("c", torch.ones(5))  # 20 bytes
    pool.prefetch(["a", "b"])
    assert a.get().sum().item() == 10
    assert pool.get("b").shape == (10,)
    pool.prefetch(["c"])  # 100 bytes: fits exactly
    assert pool.usage().cache_bytes == 100
    pool.get("a")  # a is now most recent; b is the LRU
    pool.put("d", torch.ones(5))
    pool.get("d")  # miss: 20 bytes more, evicts b (LRU)
    assert "b" not in pool._cache
    assert a.evict() is True
    assert a.evict() is False
    usage = pool.usage()
    assert (usage.hits, usage.misses, usage.transfers, usage.evictions) == (3, 1, 4, 2)
    assert usage.bytes_transferred == 40 + 40 + 20 + 20
    assert usage.cache_bytes == 40
    kinds = [(e.kind, e.name) for e in pool.events if e.name == "a"]
    assert kinds.index(("prefetch_issued", "a")) < kinds.index(("used", "a"))
    assert kinds[-1] == ("evicted", "a")


def test_randomized_cache_bound_host() -> None:
    rng = random.Random(3)
    gen = torch.Generator().manual_seed(3)
    limit = 256
    pool = TensorPool(cache_bytes=limit)
    model: dict[str, torch.Tensor] = {}
    for _ in range(400):
        op = rng.choice(["put", "put", "get", "get", "prefetch", "evict", "delete"])
        name = f"n{rng.randrange(12)}"
        if op == "put":
            dtype = rng.choice(_DTYPES)
            shape = (rng.randrange(0, 256 // (8 * dtype.itemsize) + 1), rng.randrange(1, 9))
            if name in model and (model[name].dtype, model[name].shape) != (dtype, shape):
                pool.delete(name)
                del model[name]
            model[name] = _random(shape, dtype, gen)
            pool.put(name, model[name])
        elif op == "get" and name in model:
            assert _same(pool.get(name), model[name])
        elif op == "prefetch" and model:
            names = rng.sample(sorted(model), k=min(len(model), rng.randrange(1, 4)))
            if sum(_nbytes(model[n]) for n in names) <= limit:
                pool.prefetch(names)
                assert all(n in pool._cache for n in names)
            else:
                with pytest.raises(ValueError, match="cache bound"):
                    pool.prefetch(names)
        elif op == "evict" and name in model:
            pool.evict(name)
            assert name not in pool._cache
        elif op == "delete" and name in model:
            pool.delete(name)
            del model[name]
            assert name not in pool
        usage = pool.usage()
        assert usage.cache_bytes <= limit
        assert usage.cache_bytes == sum(e.nbytes for e in pool._cache.entries())
        expected = sum(_nbytes(t) for t in model.values())
        assert usage.held_bytes == ({"host": expected} if model else {})


def test_errors() -> None:
    pool = TensorPool(cache_bytes=64)
    pool.put("w", torch.zeros(4))
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        pool.get("nope")
    with pytest.raises(KeyError, match="no tensor named 'nope'"):
        pool.prefetch(["w", "nope"])
    with pytest.raises(ValueError, match="more than the cache bound of 64 bytes"):
        pool.put("big", torch.zeros(17))
    with pytest.raises(TypeError, match=r"holds it as torch.float32, got torch.float64"):
        pool.put("w", torch.zeros(4, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"holds it with shape \(4,\), got \(2, 2\)"):
        pool.put("w", torch.zeros(2, 2))
    with pytest.raises(TypeError, match="non-empty str"):
        pool.put("", torch.zeros(1))
    with pytest.raises(TypeError, match=r"takes a torch\.Tensor"):
        pool.put("x", [1.0])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dense tensor"):
        pool.put("x", torch.zeros(2, device="meta"))
    with pytest.raises(ValueError, match="dense tensor"):
        pool.put("x", torch.zeros(2, 2).to_sparse())
    with pytest.raises(RuntimeError, match="needs a process group"):
        pool.put("x", torch.zeros(2), placement=Peer(1))
    with pytest.raises(TypeError, match="placement must be Host"):
        pool.put("x", torch.zeros(2), placement="host")  # type: ignore[arg-type]
    pool.put("y", torch.zeros(8))  # 32 bytes
    pool.prefetch(["y", "y"])  # duplicates count once: fits
    pool.put("z", torch.zeros(9))  # 36 bytes
    with pytest.raises(ValueError, match="needs 68 bytes, more than the cache bound"):
        pool.prefetch(["y", "z"])
    with pytest.raises(ValueError, match="Peer"):
        Peer(-1)
    with pytest.raises(ValueError, match="cache bound must be an int"):
        TensorPool(cache_bytes=-1)
    with pytest.raises(RuntimeError, match=r"initialized torch\.distributed"):
        pool.exchange()
    pool.delete("w")
    with pytest.raises(KeyError):
        pool.handle("w")


# ------------------------------------------------------------------------------ world 2


def _peer_round_trip() -> dict[str, Any]:
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    cases = _cases(10 + rank)
    total = sum(_nbytes(t) for t in cases.values())
    pool = TensorPool(cache_bytes=total, timeout=20.0)
    for i, (name, t) in enumerate(cases.items()):
        pool.put(name, t, placement=Peer(other) if i % 3 else Host())
    peer_names = [n for n in cases if pool.placement_of(n) == Peer(other)]
    peer_bytes = sum(_nbytes(cases[n]) for n in peer_names)
    staged = pool.usage()
    pool.exchange()  # ships the peer puts
    shipped = pool.usage()
    pool.prefetch(peer_names)
    pool.exchange()  # posts the fetches
    values = {n: pool.get(n) for n in cases}
    ok = {n: _same(values[n], cases[n]) for n in cases}
    log = [(e.kind, e.name) for e in pool.events]
    order_ok = all(
        log.index(("prefetch_issued", n))
        < log.index(("transfer_posted", n))
        < log.index(("ready", n))
        < log.index(("used", n))
        for n in peer_names
    )
    return {
        "ok": ok,
        "order_ok": order_ok,
        "staged": staged,
        "shipped": shipped,
        "final": pool.usage(),
        "peer_bytes": peer_bytes,
        "host_bytes": total - peer_bytes,
        "n_peer": len(peer_names),
        "n": len(cases),
    }


@pytest.mark.multiprocess
def test_peer_round_trip_world2() -> None:
    results = run_on_ranks(2, _peer_round_trip, timeout=60)
    for rank, res in enumerate(results):
        assert all(res["ok"].values()), [n for n, good in res["ok"].items() if not good]
        assert res["order_ok"]
        other = results[1 - rank]
        staged: PoolUsage = res["staged"]
        shipped: PoolUsage = res["shipped"]
        final: PoolUsage = res["final"]
        assert staged.staged_bytes == res["peer_bytes"]
        assert staged.held_bytes == {"host": res["host_bytes"]}
        assert shipped.staged_bytes == 0
        assert shipped.held_bytes == {
            "host": res["host_bytes"],
            f"peer:{1 - rank}": res["peer_bytes"],
        }
        assert shipped.hosted_bytes == {1 - rank: other["peer_bytes"]}
        assert final.cache_bytes == res["peer_bytes"] + res["host_bytes"] <= final.cache_limit
        assert (final.hits, final.misses) == (res["n_peer"], res["n"] - res["n_peer"])
        assert final.transfers == res["n"]
        assert final.bytes_transferred == final.cache_bytes


def _peer_randomized(rounds: int) -> dict[str, Any]:
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    rng = random.Random(100 + rank)  # each rank its own local ops; exchanges at the same points
    gen = torch.Generator().manual_seed(100 + rank)
    limit = 512
    pool = TensorPool(cache_bytes=limit, timeout=20.0)
    model: dict[str, torch.Tensor] = {}
    shipped: set[str] = set()
    places: list[Placement] = [Host(), Peer(other)]
    checked = 0

    def check() -> None:
        usage = pool.usage()
        assert usage.cache_bytes <= limit, usage
        assert usage.cache_bytes == sum(e.nbytes for e in pool._cache.entries())
        held: dict[str, int] = {}
        staged = 0
        for name, t in model.items():
            where = pool.placement_of(name)
            if where == Host() or name in shipped:
                held[str(where)] = held.get(str(where), 0) + _nbytes(t)
            else:
                staged += _nbytes(t)
        assert usage.held_bytes == held, (usage.held_bytes, held)
        assert usage.staged_bytes == staged

    for _ in range(rounds):
        for _ in range(rng.randrange(3, 9)):
            op = rng.choice(["put", "put", "get", "evict", "delete", "prefetch_host"])
            name = f"n{rng.randrange(10)}"
            if op == "put":
                dtype = rng.choice(_DTYPES)
                shape = (rng.randrange(0, 9), rng.randrange(1, 5))
                if name in model and (model[name].dtype, model[name].shape) != (dtype, shape):
                    pool.delete(name)
                    del model[name]
                model[name] = _random(shape, dtype, gen)
                pool.put(name, model[name], placement=rng.choice(places))
                shipped.discard(name)
            elif op == "get" and name in model and pool.placement_of(name) == Host():
                assert _same(pool.get(name), model[name])
                checked += 1
            elif op == "evict" and name in model:
                pool.evict(name)
            elif op == "delete" and name in model:
                pool.delete(name)
                del model[name]
                shipped.discard(name)
            elif op == "prefetch_host":
                hosts = [n for n in model if pool.placement_of(n) == Host()]
                pool.prefetch(rng.sample(hosts, k=min(2, len(hosts))))
            check()
        candidates = [n for n in model if n in shipped]
        wanted = rng.sample(candidates, k=min(len(candidates), rng.randrange(0, 5)))
        while sum(_nbytes(model[n]) for n in wanted) > limit:
            wanted.pop()
        pool.prefetch(wanted)
        check()
        pool.exchange()
        shipped.update(n for n in model if isinstance(pool.placement_of(n), Peer))
        check()
        for name in wanted:
            assert _same(pool.get(name), model[name]), name
            checked += 1
            check()
    for name in list(model):
        pool.delete(name)
    pool.exchange()
    return {"checked": checked, "final": pool.usage(), "evictions": pool.usage().evictions}


@pytest.mark.multiprocess
def test_peer_randomized_world2() -> None:
    results = run_on_ranks(2, _peer_randomized, 25, timeout=60)
    for res in results:
        assert res["checked"] > 20
        assert res["evictions"] > 0
        final: PoolUsage = res["final"]
        assert final.held_bytes == {}
        assert final.hosted_bytes == {}  # every FREE reached its holder
        assert final.cache_bytes == 0


def _peer_errors() -> list[str]:
    rank, other = dist.get_rank(), 1 - dist.get_rank()
    pool = TensorPool(cache_bytes=64, timeout=20.0)
    caught = []
    for bad in (rank, 2):
        with pytest.raises(ValueError, match="must name another rank") as info:
            pool.put("x", torch.zeros(2), placement=Peer(bad))
        caught.append(str(info.value))
    pool.put("p", torch.arange(4), placement=Peer(other))
    with pytest.raises(RuntimeError, match="not shipped yet"):
        pool.prefetch(["p"])
    pool.exchange()
    with pytest.raises(RuntimeError, match="prefetch"):
        pool.get("p")
    pool.prefetch(["p"])
    with pytest.raises(RuntimeError, match="queued but not posted"):
        pool.get("p")
    pool.exchange()
    assert torch.equal(pool.get("p"), torch.arange(4))
    pool.put("p", torch.arange(4) + 1, placement=Peer(other))  # update in place on the peer
    pool.exchange()
    pool.prefetch(["p"])
    pool.exchange()
    assert torch.equal(pool.get("p"), torch.arange(4) + 1)
    pool.put("p", torch.arange(4) + 2)  # move to host: the peer frees it at the next exchange
    pool.exchange()
    assert pool.usage().hosted_bytes == {}
    assert torch.equal(pool.get("p"), torch.arange(4) + 2)
    return caught


@pytest.mark.multiprocess
def test_peer_errors_and_updates_world2() -> None:
    results = run_on_ranks(2, _peer_errors, timeout=60)
    assert all(len(r) == 2 for r in results)
