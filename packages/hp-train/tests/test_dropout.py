"""Residual dropout (``TrainConfig.dropout``): the option, the block's formula, activation
checkpointing, tensor parallelism against one device, and each rank's random stream
(``hp_train.parallel.rng``).

The formula's oracle draws its masks from a generator the test seeds itself, the way torch's
CPU dropout draws them (``bernoulli_(1 - p)`` on a tensor of the output's shape), and computes
``x + mask * f(x) / (1 - p)`` by hand.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from hp_testing import run_on_ranks
from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig, TrainConfig
from hp_train.model.llama import Block, Transformer, lm_loss
from hp_train.parallel.activations import apply_activation_policy
from hp_train.parallel.rng import dropout_seed, seed_dropout

DENSE = ModelConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)
MOE = ModelConfig(
    dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16,
    moe=MoEConfig(n_experts=4, top_k=2, expert_ffn_dim=24, every=1, n_shared_experts=1),
)  # fmt: skip
MODELS = {"dense": DENSE, "moe": MOE}


def _batch(config: ModelConfig, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, config.vocab_size, (3, 12), generator=g)
    targets = torch.randint(0, config.vocab_size, (3, 12), generator=g)
    return ids, targets


def _pair(config: ModelConfig, p: float) -> tuple[Transformer, Transformer]:
    """A model without the argument and one with ``dropout=p``, of the same weights."""
    torch.manual_seed(0)
    plain = Transformer(config)
    with_dropout = Transformer(config, dropout=p)
    with_dropout.load_state_dict(plain.state_dict())
    return plain, with_dropout


def _grads(model: Transformer) -> dict[str, torch.Tensor]:
    out = {}
    for name, param in model.named_parameters():
        assert param.grad is not None, name
        out[name] = param.grad.clone()
    return out


# ------------------------------------------------------------------------------- option
def test_dropout_is_an_option_of_the_command_line_and_the_config_file(tmp_path: Path) -> None:
    assert TrainConfig().dropout == 0.0
    assert parse(["--dropout", "0.1"], 1)[2].dropout == 0.1
    path = tmp_path / "run.toml"
    path.write_text("[training]\ndropout = 0.25\n")
    assert parse(["--config", str(path)], 1)[2].dropout == 0.25


@pytest.mark.parametrize("bad", [-0.1, 1.0, 1.5, math.nan, math.inf, True])
def test_dropout_outside_0_to_1_is_refused(bad: float) -> None:
    with pytest.raises(ConfigError, match=r"dropout must be a probability in \[0, 1\)"):
        TrainConfig(dropout=bad)
    with pytest.raises((ValueError, TypeError), match=r"dropout must be a"):
        Transformer(DENSE, dropout=bad)


def test_command_line_names_a_bad_dropout() -> None:
    with pytest.raises(ConfigError, match=r"dropout must be a probability in \[0, 1\).*got 1\.0"):
        parse(["--dropout", "1"], 1)


# -------------------------------------------------------------------------------- model
@pytest.mark.parametrize("kind", list(MODELS))
def test_zero_dropout_is_the_model_without_the_argument(kind: str) -> None:
    """dropout=0.0 changes no bit of the loss or the gradients and draws no random number."""
    plain, zero = _pair(MODELS[kind], 0.0)
    ids, targets = _batch(MODELS[kind])
    losses = []
    for model in (plain, zero):
        torch.manual_seed(5)
        loss = lm_loss(model(ids), targets)
        loss.backward()
        assert torch.equal(torch.get_rng_state(), torch.Generator().manual_seed(5).get_state())
        losses.append(loss)
    assert torch.equal(losses[0], losses[1])
    for name, grad in _grads(plain).items():
        assert torch.equal(grad, _grads(zero)[name]), name


def _mask(like: torch.Tensor, p: float, g: torch.Generator) -> torch.Tensor:
    return torch.empty_like(like).bernoulli_(1 - p, generator=g)


@pytest.mark.parametrize("kind", list(MODELS))
def test_training_block_is_the_residual_dropout_formula(kind: str) -> None:
    """In training mode a block is ``h = x + m1 * attn(x) / (1 - p)``, ``h + m2 * ffn(h) /
    (1 - p)`` with masks from the default generator; in eval mode no mask at all."""
    p = 0.3
    torch.manual_seed(0)
    block = Block(MODELS[kind], 0, dropout=p)
    rope = Transformer(MODELS[kind])
    cos, sin = rope.cos[:12], rope.sin[:12]
    x = torch.randn(3, 12, MODELS[kind].dim, generator=torch.Generator().manual_seed(1))

    block.train()
    torch.manual_seed(7)
    got = block(x, cos, sin)

    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        attn = block.attn(block.attn_norm(x), cos, sin)
        m1 = _mask(attn, p, g)
        h = x + m1 * attn / (1 - p)
        ffn = block.ffn(block.ffn_norm(h))
        m2 = _mask(ffn, p, g)
        expected = h + m2 * ffn / (1 - p)
    assert not torch.equal(m1, m2)
    for mask in (m1, m2):  # both masks zero about p of the elements
        assert abs(float((mask == 0).float().mean()) - p) < 0.05
    torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)

    block.eval()
    before = torch.get_rng_state()
    with torch.no_grad():
        evaluated = block(x, cos, sin)
        attn = block.attn(block.attn_norm(x), cos, sin)
        h = x + attn
        undropped = h + block.ffn(block.ffn_norm(h))
    assert torch.equal(evaluated, undropped)
    assert torch.equal(torch.get_rng_state(), before), "eval mode drew random numbers"


def test_every_block_of_the_transformer_drops() -> None:
    """The Transformer hands its dropout to every block: in training mode its logits differ
    from the same weights' without dropout, in eval mode they are bit-equal."""
    plain, dropped = _pair(DENSE, 0.2)
    assert [b.dropout for b in dropped.layers.values()] == [0.2, 0.2]
    ids, _ = _batch(DENSE)
    assert not torch.equal(plain(ids), dropped(ids))
    plain.eval()
    dropped.eval()
    assert torch.equal(plain(ids), dropped(ids))


# ---------------------------------------------------------------- activation checkpointing
AC_CASES = {
    "full": TrainConfig(ac="full"),
    "selective": TrainConfig(ac="selective"),
    "budget": TrainConfig(ac="budget:0.01"),
    "selective swap": TrainConfig(ac="selective", swap=True),
    "swap": TrainConfig(swap=True),
}


@pytest.mark.parametrize("case", list(AC_CASES))
@pytest.mark.parametrize("kind", list(MODELS))
def test_checkpointing_recomputes_the_same_masks(kind: str, case: str) -> None:
    """``--ac`` / ``--swap`` with dropout give the loss and gradients of the same run without
    them, bit for bit (the recomputation restores the generator, so it redraws the forward's
    masks), and leave the generator where the plain run leaves it."""
    _, reference = _pair(MODELS[kind], 0.2)
    _, wrapped = _pair(MODELS[kind], 0.2)
    apply_activation_policy(list(wrapped.layers.values()), AC_CASES[case])
    ids, targets = _batch(MODELS[kind])
    results = []
    for model in (reference, wrapped):
        torch.manual_seed(11)
        loss = lm_loss(model(ids), targets)
        loss.backward()
        results.append((loss, _grads(model), torch.get_rng_state()))
    (ref_loss, ref_grads, ref_state), (loss, grads, state) = results
    assert torch.equal(loss, ref_loss)
    for name, grad in ref_grads.items():
        assert torch.equal(grads[name], grad), f"{case}: gradient of {name} differs"
    assert torch.equal(state, ref_state)
    reference.eval()
    with torch.no_grad():
        assert not torch.equal(lm_loss(reference(ids), targets), ref_loss), "nothing dropped"


# ------------------------------------------------------------------------- random streams
def test_dropout_seed_separates_every_place_and_every_run() -> None:
    seeds = {
        (s, dp, cp, pp): dropout_seed(s, dp, cp, pp)
        for s in range(4)
        for dp in range(8)
        for cp in range(4)
        for pp in range(4)
    }
    assert len(set(seeds.values())) == len(seeds)
    assert all(0 <= v < 2**63 for v in seeds.values())
    assert dropout_seed(1, 0) != dropout_seed(0, 1)  # neighbouring seeds share no stream
    assert dropout_seed(3, 2, 1, 1) == dropout_seed(3, 2, 1, 1)
    assert dropout_seed(3, 0) == dropout_seed(3, 0, 0, 0)


@pytest.mark.parametrize(
    "args", [(0, -1, 0, 0), (0, 0, -1, 0), (0, 0, 0, -1), (0.5, 0, 0, 0), (0, True, 0, 0)]
)
def test_dropout_seed_refuses_what_is_no_coordinate(args: tuple[Any, ...]) -> None:
    with pytest.raises(ValueError, match="must be"):
        dropout_seed(*args)


def _masks_after_seeding(parallel: ParallelConfig, seed: int) -> tuple[int, list[float]]:
    """On each rank: build the layout of ``parallel``, reseed as the trainer does, draw a mask."""
    import torch.distributed as dist

    from hp_train.parallel.parallelize import build_layout

    layout = build_layout(parallel, "cpu")
    torch.manual_seed(seed)  # every rank leaves init with the same state
    chosen = seed_dropout(TrainConfig(seed=seed), layout, dist.get_rank())
    return chosen, F.dropout(torch.ones(256), 0.5, training=True).tolist()


@pytest.mark.multiprocess
def test_tensor_parallel_peers_share_a_stream_and_other_ranks_do_not() -> None:
    """tp peers draw the same mask; data-parallel ranks, context-parallel ranks and pipeline
    stages draw different ones; each rank's seed is :func:`dropout_seed` of its place."""
    seed = 4
    layouts: dict[str, tuple[ParallelConfig, list[int]]] = {
        # the expected dropout_seed coordinates (dp, cp, pp) of ranks 0 and 1
        "tp": (ParallelConfig(tp=2), [dropout_seed(seed, 0), dropout_seed(seed, 0)]),
        "dp_shard": (ParallelConfig(dp_shard=2), [dropout_seed(seed, 0), dropout_seed(seed, 1)]),
        "dp_replicate": (
            ParallelConfig(dp_replicate=2),
            [dropout_seed(seed, 0), dropout_seed(seed, 1)],
        ),
        "cp": (ParallelConfig(cp=2), [dropout_seed(seed, 0, 0), dropout_seed(seed, 0, 1)]),
        "pp": (ParallelConfig(pp=2), [dropout_seed(seed, 0, 0, 0), dropout_seed(seed, 0, 0, 1)]),
    }
    for name, (parallel, expected) in layouts.items():
        ranks = run_on_ranks(2, _masks_after_seeding, parallel, seed, timeout=120)
        assert [chosen for chosen, _ in ranks] == expected, name
        same = ranks[0][1] == ranks[1][1]
        assert same == (name == "tp"), f"{name}: masks {'equal' if same else 'differ'}"


# ---------------------------------------------------------------- tensor parallelism, trainer
def _train(parallel: ParallelConfig, config: TrainConfig, out: str) -> dict[int, float]:
    from hp_train.runtime import init_runtime
    from hp_train.trainer import RunOptions, train

    runtime = init_runtime("cpu", threads=1)
    options = RunOptions(out_dir=Path(out) / f"rank{runtime.rank}", quiet=True)
    summary = train(DENSE, parallel, config, options, runtime)
    return summary.losses


# As test_training's ADAMW_LOSS_TOLERANCE: fp32 rounding of TP's other summation order.
TP_LOSS_TOLERANCE = 2e-6


@pytest.mark.multiprocess
def test_tensor_parallel_run_with_dropout_matches_one_device(tmp_path: Path) -> None:
    """The trainer with ``--dropout 0.1`` at tp=2 gives one device's losses (the same seed)
    within TP's rounding: both tp ranks drop the elements one device drops. The losses differ
    from a run without dropout, so the trainer does pass the option to the model."""
    base: dict[str, Any] = {"steps": 4, "global_batch": 4, "seq_len": 12, "data": "synthetic"}
    config = TrainConfig(**base, optimizer="adamw", dropout=0.1)
    (one,) = run_on_ranks(1, _train, ParallelConfig(), config, str(tmp_path / "one"), timeout=300)
    two = run_on_ranks(2, _train, ParallelConfig(tp=2), config, str(tmp_path / "tp"), timeout=300)
    plain_config = TrainConfig(**base, optimizer="adamw")
    (plain,) = run_on_ranks(
        1, _train, ParallelConfig(), plain_config, str(tmp_path / "plain"), timeout=300
    )
    assert two[0] == two[1]
    worst = max(abs(two[0][s] - one[s]) for s in one)
    print(f"tp=2 vs one device with dropout 0.1: max |loss difference| {worst:.3g}")
    assert worst <= TP_LOSS_TOLERANCE
    assert min(abs(plain[s] - one[s]) for s in one) > 1e-4, "dropout changed no loss"


# ---------------------------------------------------------------------- context parallelism
def _cp_block_against_formula(p: float, seed: int) -> tuple[float, list[float]]:
    """On each of 2 cp ranks: one block under ring attention on this rank's zigzag columns,
    against the formula on one device's attention output at those columns, with the masks of
    this rank's seed; the largest difference and the first mask's values."""
    import torch.distributed as dist

    from hp_dtensor.parallel import local_positions
    from hp_train.parallel.context import CP_AXIS, apply_context_parallel
    from hp_train.parallel.parallelize import build_layout

    torch.set_num_threads(1)
    layout = build_layout(ParallelConfig(cp=2), "cpu")
    assert layout.cp_mesh is not None
    torch.manual_seed(0)
    model = Transformer(CP_MODEL, dropout=p)
    whole = Transformer(CP_MODEL)
    whole.load_state_dict(model.state_dict())
    apply_context_parallel(model, layout.cp_mesh, "ring")
    seq = 16
    x = torch.randn(2, seq, CP_MODEL.dim, generator=torch.Generator().manual_seed(1))
    columns = local_positions(seq, layout.cp_mesh, CP_AXIS)
    rank = dist.get_rank()
    seed_dropout(TrainConfig(seed=seed), layout, rank)
    block = model.layers["0"]
    got = block(x[:, columns], model.cos[columns], model.sin[columns])

    ref = whole.layers["0"]
    assert isinstance(ref, Block)
    g = torch.Generator().manual_seed(dropout_seed(seed, 0, cp_rank=rank))
    with torch.no_grad():
        attn = ref.attn(ref.attn_norm(x), whole.cos[:seq], whole.sin[:seq])[:, columns]
        m1 = _mask(attn, p, g)
        h = x[:, columns] + m1 * attn / (1 - p)
        ffn = ref.ffn(ref.ffn_norm(h))
        expected = h + _mask(ffn, p, g) * ffn / (1 - p)
    return float((got - expected).abs().max()), m1.flatten().tolist()


CP_MODEL = ModelConfig(dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=16)


@pytest.mark.multiprocess
def test_context_parallel_ranks_drop_their_own_columns_by_the_formula() -> None:
    """Under cp=2 each rank's block output is the dropout formula on one device's attention at
    its columns, with masks from its own stream (the ranks' masks differ)."""
    ranks = run_on_ranks(2, _cp_block_against_formula, 0.25, 9, timeout=120)
    for rank, (err, _) in enumerate(ranks):
        assert err < 1e-5, f"cp rank {rank}: off the formula by {err:.2e}"
    assert ranks[0][1] != ranks[1][1]


# ----------------------------------------------------------------------------- compile
def test_compiled_blocks_drop_as_the_eager_ones() -> None:
    """``--compile`` compiles each block's attention and feed-forward; the dropout lies between
    them and the residual stream, outside the compiled code, so a compiled model draws the
    eager model's masks: the same loss and gradients (to inductor's rounding)."""
    from hp_train.parallel.compiled import compile_blocks

    config = ModelConfig(dim=32, n_layers=1, n_heads=4, ffn_dim=48, max_seq_len=16)
    plain, eager = _pair(config, 0.2)
    _, compiled = _pair(config, 0.2)
    compile_blocks(list(compiled.layers.values()))
    ids, targets = _batch(config)
    results = []
    for model in (eager, compiled):
        torch.manual_seed(3)
        loss = lm_loss(model(ids), targets)
        loss.backward()
        results.append((loss, _grads(model)))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-4, atol=1e-6)
    with torch.no_grad():
        torch.manual_seed(3)
        assert not torch.allclose(lm_loss(plain(ids), targets), results[0][0]), "nothing dropped"


# ---------------------------------------------------------------------------- pipelining
@pytest.mark.multiprocess
def test_pipelined_run_with_dropout_trains(tmp_path: Path) -> None:
    """pp=2 with dropout: each stage drops in its own blocks (the stages' backward runs on the
    autograd graph of their forward, masks included, and nothing is recomputed); the run
    trains to finite losses that dropout changes, the same on a rerun."""
    base: dict[str, Any] = {"steps": 3, "global_batch": 4, "seq_len": 12, "data": "synthetic"}
    config = TrainConfig(**base, optimizer="adamw", dropout=0.1, microbatches=2)
    plain = TrainConfig(**base, optimizer="adamw", microbatches=2)
    pp = ParallelConfig(pp=2)
    runs = [
        run_on_ranks(2, _train, pp, c, str(tmp_path / name), timeout=300)
        for name, c in (("a", config), ("b", config), ("plain", plain))
    ]
    dropped, again, undropped = (run[1] for run in runs)  # the last stage's losses
    assert sorted(dropped) == [0, 1, 2]
    assert all(math.isfinite(v) for v in dropped.values())
    assert dropped == again
    assert min(abs(dropped[s] - undropped[s]) for s in dropped) > 1e-4, "dropout changed nothing"
