"""Prefetch and resharding, observed: which all-gathers a step issues, in what order, what is
unsharded at each moment, and that none of it changes the numbers.

``hp_testing.llama.Llama`` (fp32, three blocks: four FSDP groups with the root) on world 2. A
dispatch mode logs every parameter all-gather as it is issued (the group it fills, found by the
output buffer, and the other groups unsharded at that moment), between markers logged when each
group's forward starts and when its outputs' gradient arrives (its backward starts). Logged
steps come after a warm-up step, which records the forward order implicit prefetch follows.

* ``set_implicit_prefetch(False)``: each group is gathered when its own forward or backward
  starts, and only the root stays unsharded beside it.
* Default (``hp_fsdp.policy.default_prefetch``: both directions, on CPU as on accelerators),
  and ``set_implicit_prefetch(True)``: each group's forward and backward start issue the next
  group's all-gather, so two blocks are unsharded at a time; the root's backward start issues
  the last block's, which gathers under the head's backward.
* ``set_implicit_prefetch(True, max_bytes=...)`` below a block's unsharded bytes: forward
  prefetches as before, backward gathers each block when it starts (what backward prefetch
  would add to the peak is over the limit).
* ``set_modules_to_forward_prefetch`` / ``set_modules_to_backward_prefetch``: the listed
  modules' all-gathers are issued, in list order, when that module's forward (backward) starts.
* ``fully_shard(..., reshard_after_forward=False)``: one all-gather per group per step (not two
  per block), everything unsharded from forward to the end of backward.
* ``set_reshard_after_backward(False)`` during gradient accumulation: the parameters stay
  unsharded between micro-batches, so the later micro-batches gather less (nothing at all with
  ``reshard_after_forward=False``); set back to True on the last one, everything is freed.
* Numerics: every variant's losses, gradients and AdamW-updated parameters equal those of the
  run without prefetch bit for bit (fp32 on CPU; they only move when an all-gather is issued or
  a buffer is freed, never what is computed).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, cast

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hp_fsdp.counting import current_purpose, op_name
from hp_fsdp.policy import PrefetchPolicy
from hp_testing import run_on_ranks
from hp_testing.llama import Llama, LlamaConfig

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, ffn_dim=64, max_seq_len=16)
BLOCKS = [f"layers.{i}" for i in range(CONFIG.n_layers)]
GROUPS = ["root", *BLOCKS]
MICRO_BATCHES = 3


def _batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + dist.get_rank())
    ids = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)
    return ids, torch.randint(0, CONFIG.vocab_size, (2, 16), generator=g)


def _model(reshard_after_forward: bool = True, nested: bool = False) -> nn.Module:
    from hp_dtensor import DeviceMesh
    from hp_fsdp import fully_shard
    from hp_layout import Mesh

    mesh = DeviceMesh("cpu", Mesh((dist.get_world_size(),), ("shard",)))
    torch.manual_seed(0)
    model = Llama(CONFIG)
    for block in model.layers:
        if nested:
            fully_shard(block.ffn, mesh=mesh)
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard_after_forward)
    fully_shard(model, mesh=mesh)
    return model


def _modules(model: nn.Module, nested: bool = False) -> dict[str, nn.Module]:
    layers: Any = model.layers
    out = {"root": model, **{name: layers[i] for i, name in enumerate(BLOCKS)}}
    if nested:
        out |= {f"{name}.ffn": layers[i].ffn for i, name in enumerate(BLOCKS)}
    return out


def _state(module: nn.Module) -> Any:
    return cast(Any, module)._hp_fsdp_state


def _group(module: nn.Module) -> Any:
    return _state(module).group


def _unsharded(model: nn.Module) -> dict[str, bool]:
    """Per group: whether its unsharded parameters exist (checked two ways that must agree: the
    unsharded buffer holds memory, and the module holds the unsharded views)."""
    out = {}
    for name, module in _modules(model).items():
        group = _group(module)
        allocated = group.unsharded_flat.untyped_storage().nbytes() > 0
        registered = [p.module._parameters[p.name] is p.unsharded for p in group.params]
        assert all(registered) == allocated, (name, registered)
        assert any(registered) == allocated, (name, registered)
        out[name] = allocated
    return out


class _GatherLog(TorchDispatchMode):
    """Logs each parameter all-gather issued under it as ``"gather G [+H,...]"``: the group G
    whose unsharded buffer is the output, and the other groups H unsharded at that moment."""

    def __init__(self, modules: dict[str, nn.Module]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.groups = {name: _group(m) for name, m in modules.items()}
        self.events: list[str] = []

    def __torch_dispatch__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        name = op_name(func)
        # Over a pair of gloo ranks the all-gather is an exchange into the peer's slice.
        exchanged = name == "c10d.alltoall_base_" and current_purpose() == "param_all_gather"
        if name == "c10d._allgather_base_" or exchanged:
            output = args[0].untyped_storage()
            owner = [
                n
                for n, g in self.groups.items()
                if g.unsharded_flat.untyped_storage().data_ptr() == output.data_ptr()
            ]
            assert len(owner) == 1, owner
            resident = [
                n
                for n, g in self.groups.items()
                if n != owner[0] and g.unsharded_flat.untyped_storage().nbytes() > 0
            ]
            self.events.append(f"gather {owner[0]} [+{','.join(resident)}]")
        return func(*args, **kwargs)


def _add_markers(modules: dict[str, nn.Module], events: list[str]) -> None:
    """Log ``"forward G"`` before group G's forward hooks run (prepended, so before fully_shard's
    pre-forward issues anything) and ``"backward G"`` when the gradient of G's output arrives
    (a tensor hook registered before fully_shard's pre-backward hook, so it runs first)."""

    def on_forward(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            events.append(f"forward {name}")

        return hook

    def on_output(name: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: torch.Tensor) -> None:
            def backward(grad: torch.Tensor) -> None:
                events.append(f"backward {name}")

            output.register_hook(backward)

        return hook

    for name, module in modules.items():
        module.register_forward_pre_hook(on_forward(name), prepend=True)
        module.register_forward_hook(on_output(name), prepend=True)


def _loss(model: nn.Module, step: int) -> torch.Tensor:
    ids, targets = _batch(step)
    logits = model(ids)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def _snapshot(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's sharded parameters and gradients (clones)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().clone()
        if p.grad is not None:
            out[f"{name}.grad"] = p.grad.detach().clone()
    return out


def _prefetch_run(variant: str) -> dict[str, Any]:
    """A warm-up AdamW step, then a logged one, under ``variant`` ("none", "default",
    "implicit", "capped", "explicit"); the log, and the losses, gradients and parameters for the
    numerics."""
    model = _model()
    modules = _modules(model)
    states = [_state(m) for m in modules.values()]
    default_flags = [s.implicit_prefetch for s in states]
    if variant == "none":
        model.set_implicit_prefetch(False)  # type: ignore[operator]
    elif variant == "implicit":
        model.set_implicit_prefetch(True)  # type: ignore[operator]
    elif variant == "capped":
        block = _state(modules["layers.0"]).groups[0].unsharded_bytes
        model.set_implicit_prefetch(True, max_bytes=block - 1)  # type: ignore[operator]
    elif variant == "explicit":
        layers: Any = model.layers
        layers[0].set_modules_to_forward_prefetch([layers[2], layers[1]])
        layers[2].set_modules_to_backward_prefetch([layers[0], layers[1]])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    log = _GatherLog(modules)
    _add_markers(modules, log.events)
    for step in range(2):
        optimizer.zero_grad(set_to_none=True)
        log.events.clear()
        with log:
            loss = _loss(model, step)
            loss.backward()
        losses.append(loss.item())
        grads = _snapshot(model)
        optimizer.step()
    return {
        "default_flags": default_flags,
        "flags": [s.implicit_prefetch for s in states],
        "log": list(log.events),
        "losses": losses,
        "grads": grads,
        "params": _snapshot(model),
        "after": _unsharded(model),
    }


def _prefetch() -> dict[str, dict[str, Any]]:
    torch.set_num_threads(1)
    return {v: _prefetch_run(v) for v in ("none", "default", "implicit", "capped", "explicit")}


def _reshard_run(reshard_after_forward: bool, keep_between_micro_batches: bool) -> dict[str, Any]:
    """Gradient accumulation over MICRO_BATCHES (sync on the last only), parameters kept
    unsharded between micro-batches or not; all-gathers per micro-batch, what is unsharded after
    each forward and backward, and the numbers."""
    from hp_fsdp.counting import CountingMode

    model = _model(reshard_after_forward)
    fsdp = cast(Any, model)
    _loss(model, 0).backward()  # warm-up (forward order; a step without an optimizer step)
    model.zero_grad(set_to_none=True)
    gathers, after_forward, after_backward, losses = [], [], [], []
    for micro in range(MICRO_BATCHES):
        last = micro == MICRO_BATCHES - 1
        fsdp.set_requires_gradient_sync(last)
        fsdp.set_reshard_after_backward(last or not keep_between_micro_batches)
        with CountingMode() as counts:
            loss = _loss(model, 1 + micro)
            after_forward.append(_unsharded(model))
            loss.backward()
        after_backward.append(_unsharded(model))
        gathers.append(sum(1 for c in counts.collectives if c.purpose == "param_all_gather"))
        losses.append(loss.item())
    return {
        "gathers": gathers,
        "after_forward": after_forward,
        "after_backward": after_backward,
        "losses": losses,
        "grads": _snapshot(model),
    }


def _reshard() -> dict[tuple[bool, bool], dict[str, Any]]:
    torch.set_num_threads(1)
    return {(raf, keep): _reshard_run(raf, keep) for raf in (True, False) for keep in (False, True)}


def _nested_run() -> list[str]:
    """A warm-up step, then the log of one with implicit prefetch in both directions, each
    block's feed-forward a group of its own inside the block's."""
    torch.set_num_threads(1)
    model = _model(nested=True)
    model.set_implicit_prefetch(True)  # type: ignore[operator]
    modules = _modules(model, nested=True)
    log = _GatherLog(modules)
    _add_markers(modules, log.events)
    _loss(model, 0).backward()
    log.events.clear()
    with log:
        _loss(model, 1).backward()
    return list(log.events)


@functools.cache
def _prefetch_results() -> list[dict[str, dict[str, Any]]]:
    return run_on_ranks(2, _prefetch)


@functools.cache
def _reshard_results() -> list[dict[tuple[bool, bool], dict[str, Any]]]:
    return run_on_ranks(2, _reshard)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _forward(log: list[str]) -> list[str]:
    return log[: log.index("backward root")]


def _backward(log: list[str]) -> list[str]:
    return log[log.index("backward root") :]


_FORWARD_PREFETCHED = [
    "forward root",
    "gather root [+]",
    "gather layers.0 [+root]",
    "forward layers.0",
    "gather layers.1 [+root,layers.0]",
    "forward layers.1",
    "gather layers.2 [+root,layers.1]",
    "forward layers.2",
]
_BACKWARD_UNPREFETCHED = [
    "backward root",
    "backward layers.2",
    "gather layers.2 [+root]",
    "backward layers.1",
    "gather layers.1 [+root]",
    "backward layers.0",
    "gather layers.0 [+root]",
]


@pytest.mark.multiprocess
def test_without_prefetch_each_group_gathers_when_it_starts() -> None:
    """With implicit prefetch off, each group is all-gathered when its own forward or backward
    starts, beside the root only (the root keeps its parameters)."""
    for result in _prefetch_results():
        run = result["none"]
        print(run["log"])
        assert run["flags"] == [PrefetchPolicy(False, False)] * len(GROUPS)
        assert _forward(run["log"]) == [
            "forward root",
            "gather root [+]",
            "forward layers.0",
            "gather layers.0 [+root]",
            "forward layers.1",
            "gather layers.1 [+root]",
            "forward layers.2",
            "gather layers.2 [+root]",
        ]
        assert _backward(run["log"]) == _BACKWARD_UNPREFETCHED
        assert run["after"] == dict.fromkeys(GROUPS, False)


@pytest.mark.multiprocess
def test_default_prefetch_is_both_directions() -> None:
    """The default (``default_prefetch``) prefetches in both directions on CPU too: the log of
    ``set_implicit_prefetch(True)``, and the numbers of the run without prefetch."""
    for result in _prefetch_results():
        run, forced, none = result["default"], result["implicit"], result["none"]
        print(run["log"])
        assert run["default_flags"] == [PrefetchPolicy(True, True)] * len(GROUPS)
        assert run["log"] == forced["log"]
        assert run["after"] == dict.fromkeys(GROUPS, False)
        assert run["losses"] == none["losses"]
        assert _same(run["grads"], none["grads"])
        assert _same(run["params"], none["params"])


@pytest.mark.multiprocess
def test_backward_prefetch_stays_within_max_bytes() -> None:
    """``max_bytes`` below a block's unsharded bytes: backward gathers each block when it
    starts (prefetching it would add a block to the peak), forward still prefetches; the
    numbers are those without prefetch."""
    for result in _prefetch_results():
        run, none = result["capped"], result["none"]
        print(run["log"])
        assert [f.max_bytes for f in run["flags"]] == [run["flags"][0].max_bytes] * len(GROUPS)
        assert _forward(run["log"]) == _FORWARD_PREFETCHED
        assert _backward(run["log"]) == _BACKWARD_UNPREFETCHED
        assert run["losses"] == none["losses"]
        assert _same(run["grads"], none["grads"])


@pytest.mark.multiprocess
def test_implicit_prefetch_gathers_the_next_group_early() -> None:
    """Implicit prefetch issues the next group's all-gather, in forward order and in reverse,
    when a group starts: two blocks are unsharded at once; the losses, gradients and updated
    parameters are those without prefetch."""
    for result in _prefetch_results():
        run, default = result["implicit"], result["none"]
        print(run["log"])
        assert run["flags"] == [PrefetchPolicy(True, True)] * len(GROUPS)
        assert _forward(run["log"]) == _FORWARD_PREFETCHED
        assert _backward(run["log"]) == [
            "backward root",
            "gather layers.2 [+root]",  # under the head's backward
            "backward layers.2",
            "gather layers.1 [+root,layers.2]",
            "backward layers.1",
            "gather layers.0 [+root,layers.1]",
            "backward layers.0",
        ]
        assert run["after"] == dict.fromkeys(GROUPS, False)
        assert run["losses"] == default["losses"]
        assert _same(run["grads"], default["grads"])
        assert _same(run["params"], default["params"])


@pytest.mark.multiprocess
def test_backward_prefetches_in_the_order_backward_runs() -> None:
    """Nested groups (each block's feed-forward inside the block's group): backward prefetch
    follows the reverse of the order forwards finished in, the order backward needs them: the
    root's start gathers the last block, a block's start its feed-forward, a feed-forward's
    start the block before; every group but the last block's is gathered ahead of its backward.
    (Prefetching by forward start order instead sent a block's start to the previous block's
    feed-forward, and every block and feed-forward gathered when its backward began.)"""
    for log in run_on_ranks(2, _nested_run):
        print(log)
        assert [e.split(" [")[0] for e in _backward(log)] == [
            "backward root",
            "gather layers.2",
            "backward layers.2",
            "gather layers.2.ffn",
            "backward layers.2.ffn",
            "gather layers.1",
            "backward layers.1",
            "gather layers.1.ffn",
            "backward layers.1.ffn",
            "gather layers.0",
            "backward layers.0",
            "gather layers.0.ffn",
            "backward layers.0.ffn",
        ]


@pytest.mark.multiprocess
def test_explicit_prefetch_lists_set_the_gather_order() -> None:
    """``layers[0]`` prefetches ``[layers[2], layers[1]]`` in forward and ``layers[2]``
    prefetches ``[layers[0], layers[1]]`` in backward: those all-gathers are issued, in list
    order, when that block starts; the prefetched blocks gather nothing when they start. The
    modules without a list keep the default (the root prefetches ``layers[0]`` in forward and
    ``layers[2]`` in backward). The numbers are those without prefetch."""
    for result in _prefetch_results():
        run, default = result["explicit"], result["none"]
        print(run["log"])
        assert _forward(run["log"]) == [
            "forward root",
            "gather root [+]",
            "gather layers.0 [+root]",
            "forward layers.0",
            "gather layers.2 [+root,layers.0]",
            "gather layers.1 [+root,layers.0,layers.2]",
            "forward layers.1",
            "forward layers.2",
        ]
        assert _backward(run["log"]) == [
            "backward root",
            "gather layers.2 [+root]",
            "backward layers.2",
            "gather layers.0 [+root,layers.2]",
            "gather layers.1 [+root,layers.0,layers.2]",
            "backward layers.1",
            "backward layers.0",
        ]
        assert run["after"] == dict.fromkeys(GROUPS, False)
        assert run["losses"] == default["losses"]
        assert _same(run["grads"], default["grads"])
        assert _same(run["params"], default["params"])


@pytest.mark.multiprocess
def test_reshard_after_forward_and_backward_set_gathers_and_freeing() -> None:
    """All-gathers per micro-batch, and what is unsharded after each forward and backward:

    * default: 2 per block (forward, then again in backward) + 1 for the root = 7 per
      micro-batch; after forward only the root is unsharded, after backward nothing;
    * ``reshard_after_forward=False``: 1 per group = 4; everything unsharded after forward;
    * ``set_reshard_after_backward(False)`` on all but the last micro-batch: nothing freed after
      those backward passes, so the next forward gathers nothing (7, 3, 3 with resharding after
      forward; 4, 0, 0 without); True on the last frees everything.

    The accumulated gradients equal those of the default path bit for bit."""
    blocks = CONFIG.n_layers
    for result in _reshard_results():
        for (raf, keep), run in result.items():
            print(f"reshard_after_forward={raf} keep={keep}: {run['gathers']}")
        default = result[(True, False)]
        only_root = {"root": True} | dict.fromkeys(BLOCKS, False)
        everything = dict.fromkeys(GROUPS, True)
        nothing = dict.fromkeys(GROUPS, False)
        assert default["gathers"] == [2 * blocks + 1] * MICRO_BATCHES
        assert default["after_forward"] == [only_root] * MICRO_BATCHES
        assert default["after_backward"] == [nothing] * MICRO_BATCHES

        kept = result[(False, False)]
        assert kept["gathers"] == [blocks + 1] * MICRO_BATCHES
        assert kept["after_forward"] == [everything] * MICRO_BATCHES
        assert kept["after_backward"] == [nothing] * MICRO_BATCHES

        between = result[(True, True)]
        assert between["gathers"] == [2 * blocks + 1, blocks, blocks]
        assert between["after_forward"] == [only_root] * MICRO_BATCHES
        assert between["after_backward"] == [everything, everything, nothing]

        never = result[(False, True)]
        assert never["gathers"] == [blocks + 1, 0, 0]
        assert never["after_forward"] == [everything] * MICRO_BATCHES
        assert never["after_backward"] == [everything, everything, nothing]

        for run in (kept, between, never):
            assert run["losses"] == default["losses"]
            assert _same(run["grads"], default["grads"])
