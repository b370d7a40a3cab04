"""Hugging Face checkpoints in and out of hp-train, against ``transformers`` itself.

Tiny random ``LlamaForCausalLM`` (grouped-query attention, untied, rope_theta 5e5 with Llama
3.1's rotary scaling), ``Qwen2ForCausalLM`` (q/k/v biases, tied embeddings, linear rotary
scaling) and ``Qwen3ForCausalLM`` (per-head q/k norms, head_dim 16 != hidden / heads = 8),
fp32, saved with ``save_pretrained``; their norm weights and biases are drawn at random too
(``transformers`` initializes them to ones and zeros, which would hide a mix-up):

* one rank: ``read_hf_config`` + ``Transformer`` + ``load_hf_weights`` gives transformers'
  logits (also from a sharded save with an index);
* world 4, FSDP x TP: the same logits, and each rank read only its own pieces (counted);
* world 4, FSDP x TP: a few AdamW steps follow one device's, the checkpoint exported by
  ``python -m hp_train.checkpoint.export`` loads in transformers with the trained model's logits;
* bad inputs fail naming what is wrong.

Tolerances are relative to the largest logit. On one rank hp-train computes transformers'
operations in the same order, so the logits are bit-equal (measured 0.0; bound 1e-6). Under
FSDP x TP the row-wise projections sum their partial products across ranks in another order
(measured 1.6e-6 for the Llama model, 6.1e-7 Qwen2, 4.9e-7 Qwen3, 1.6e-7 for the exported
trained model; bound 4e-6).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from hp_testing import run_on_ranks
from hp_train.checkpoint.dcp import save_checkpoint
from hp_train.checkpoint.export import CONFIG_NAME
from hp_train.checkpoint.export import main as export_main
from hp_train.checkpoint.hf import (
    WeightsMismatchError,
    export_hf,
    hf_config_dict,
    hf_name,
    load_hf_weights,
    read_hf_config,
)
from hp_train.checkpoint.hf.safetensors_index import SafetensorsCheckpoint
from hp_train.config.schema import (
    ConfigError,
    ModelConfig,
    MoEConfig,
    ParallelConfig,
    RopeScaling,
    TrainConfig,
)
from hp_train.model.llama import Transformer
from hp_train.optim import build_optimizer
from hp_train.parallel.parallelize import build_layout, check_model_fits, parallelize
from hp_train.parallel.pipeline import keep_stage, stage_boundaries

VOCAB, SEQ, BATCH = 64, 16, 2
ONE_RANK_TOLERANCE = 1e-6
PARALLEL_TOLERANCE = 4e-6
FSDP_X_TP = ParallelConfig(dp_shard=2, tp=2)

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    # Larger weights than the default 0.02: sharper attention, positions that matter.
    "initializer_range": 0.2,
    "attn_implementation": "sdpa",
}
_LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    # Short, so the scaling changes frequencies the test's 16 positions see.
    "original_max_position_embeddings": 16,
}
# Class names in transformers (imported where used: the rank processes import this module and
# need no transformers).
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("Llama", {"rope_parameters": _LLAMA3}),
    "qwen2": (
        "Qwen2",
        {
            "tie_word_embeddings": True,
            "rope_parameters": {"rope_type": "linear", "rope_theta": 20000.0, "factor": 2.0},
        },
    ),
    "qwen3": ("Qwen3", {"head_dim": 16}),
}


def _hf_model(kind: str, seed: int = 0) -> nn.Module:
    import transformers

    prefix, extra = KINDS[kind]
    config = getattr(transformers, f"{prefix}Config")(**_COMMON, **extra)
    torch.manual_seed(seed)
    model: nn.Module = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def _save_hf(kind: str, folder: Path, **save: Any) -> Path:
    model: Any = _hf_model(kind)
    model.save_pretrained(folder, **save)
    return folder


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    folders = {kind: _save_hf(kind, root / kind) for kind in KINDS}
    # ~2.6 KiB per 32 x 32 matrix: several shards and an index.
    folders["llama_sharded"] = _save_hf("llama", root / "llama_sharded", max_shard_size="20KB")
    return folders


def _ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf_logits(folder: Path, ids: torch.Tensor) -> torch.Tensor:
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    with torch.no_grad():
        logits: torch.Tensor = model(input_ids=ids).logits
    return logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.abs().max())


# --- one rank ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", [*KINDS, "llama_sharded"])
def test_one_rank_logits_equal_transformers(kind: str, hf_folders: dict[str, Path]) -> None:
    folder = hf_folders[kind]
    if kind == "llama_sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 2
    config = read_hf_config(folder)
    model = Transformer(config)
    load_hf_weights(model, folder)
    ids = _ids()
    with torch.no_grad():
        got = model(ids)
    assert _relative(got, _hf_logits(folder, ids)) <= ONE_RANK_TOLERANCE


def test_read_hf_config_maps_every_option(hf_folders: dict[str, Path]) -> None:
    llama = read_hf_config(hf_folders["llama"])
    assert (llama.n_heads, llama.n_kv_heads, llama.head_dim, llama.norm_eps) == (4, 2, 8, 1e-5)
    assert llama.rope_theta == 500000.0
    assert llama.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 16)
    assert (llama.tie_embeddings, llama.qkv_bias, llama.qk_norm) == (False, False, False)
    qwen2 = read_hf_config(hf_folders["qwen2"], max_seq_len=32)
    assert (qwen2.qkv_bias, qwen2.o_bias, qwen2.tie_embeddings) == (True, False, True)
    assert (qwen2.rope_scaling, qwen2.rope_theta) == (RopeScaling("linear", 2.0), 20000.0)
    assert qwen2.max_seq_len == 32
    qwen3 = read_hf_config(hf_folders["qwen3"])
    assert (qwen3.qk_norm, qwen3.explicit_head_dim, qwen3.head_dim) == (True, 16, 16)
    assert qwen3.max_seq_len == 64
    with pytest.raises(ConfigError, match=r"max_seq_len=128 exceeds .* max_position_embeddings=64"):
        read_hf_config(hf_folders["qwen3"], max_seq_len=128)
    for config in (llama, qwen2, qwen3):
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# --- world 4: FSDP x TP --------------------------------------------------------------------


def _counting_reads() -> tuple[dict[str, int], Callable[[], None]]:
    """Wrap the safetensors reader: elements read per tensor name (undone by the callable)."""
    counts: dict[str, int] = {}
    original = SafetensorsCheckpoint.read

    def read(self: SafetensorsCheckpoint, name: str, box: Any) -> torch.Tensor:
        out = original(self, name, box)
        counts[name] = counts.get(name, 0) + out.numel()
        return out

    SafetensorsCheckpoint.read = read  # type: ignore[method-assign]

    def undo() -> None:
        SafetensorsCheckpoint.read = original  # type: ignore[method-assign]

    return counts, undo


def _load_laid_out(folders: list[str], ids: torch.Tensor) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    for folder in folders:
        config = read_hf_config(folder)
        torch.manual_seed(123)  # any values: the checkpoint must replace them all
        model = Transformer(config)
        parallelize(model, build_layout(FSDP_X_TP, "cpu"))
        counts, undo = _counting_reads()
        try:
            load_hf_weights(model, folder)
        finally:
            undo()
        with torch.no_grad():
            logits = model(ids)
        results.append({"logits": logits.detach().clone(), "read": counts})
    return results


def _tp_sharded(name: str) -> bool:
    """Whether the TP plan splits tensor ``name`` (then FSDP halves each TP piece again)."""
    return not (name.endswith("norm.weight") or name.endswith("o_proj.bias"))


@pytest.mark.multiprocess
def test_fsdp_x_tp_load_reads_own_pieces_and_gives_transformers_logits(
    hf_folders: dict[str, Path],
) -> None:
    kinds = list(KINDS)
    ids = _ids()
    per_rank = run_on_ranks(
        4, _load_laid_out, [str(hf_folders[k]) for k in kinds], ids, timeout=300
    )
    for i, kind in enumerate(kinds):
        want = _hf_logits(hf_folders[kind], ids)
        shapes = {
            k: v.numel() for k, v in load_file(hf_folders[kind] / "model.safetensors").items()
        }
        # A quarter of each TP-split tensor, half of each replicated one (FSDP's 2 shards).
        own = sum(n // 4 if _tp_sharded(k) else n // 2 for k, n in shapes.items())
        for rank, results in enumerate(per_rank):
            got = results[i]
            assert _relative(got["logits"], want) <= PARALLEL_TOLERANCE, (kind, rank)
            assert set(got["read"]) == set(shapes), kind
            assert sum(got["read"].values()) == own, (kind, rank, own, sum(shapes.values()))


def _load_stage(folder: str) -> dict[str, Any]:
    """Pipeline stage of a pp=2 x tp=2 layout: load, then gather what the stage holds."""
    torch.set_num_threads(1)
    config = read_hf_config(folder)
    layout = build_layout(ParallelConfig(tp=2, pp=2), "cpu")
    assert layout.pipeline_mesh is not None
    stage = layout.pipeline_mesh.mesh.coordinate(dist.get_rank())[0]
    torch.manual_seed(123)
    model = keep_stage(Transformer(config), stage, stage_boundaries(config, 2))
    parallelize(model, layout)
    counts, undo = _counting_reads()
    try:
        load_hf_weights(model, folder)
    finally:
        undo()
    whole = {}
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor)
        whole[hf_name(name)] = value.full_tensor().clone()
    return {"stage": stage, "read": counts, "whole": whole}


@pytest.mark.multiprocess
def test_pipeline_stage_reads_and_loads_only_its_modules(hf_folders: dict[str, Path]) -> None:
    folder = hf_folders["llama"]
    stored = load_file(folder / "model.safetensors")
    per_rank = run_on_ranks(4, _load_stage, str(folder), timeout=300)
    stage_names: dict[int, set[str]] = {}
    for result in per_rank:
        names = set(result["whole"])
        assert names == set(result["read"])
        stage_names.setdefault(result["stage"], names)
        assert stage_names[result["stage"]] == names
        for name, value in result["whole"].items():
            assert torch.equal(value, stored[name]), name
    first, last = stage_names[0], stage_names[1]
    assert "model.embed_tokens.weight" in first
    assert "lm_head.weight" not in first
    assert "lm_head.weight" in last
    assert "model.embed_tokens.weight" not in last
    assert not first & last
    assert first | last == set(stored)


# --- world 4: train, save, export ----------------------------------------------------------

TRAIN = TrainConfig(steps=3, optimizer="adamw", lr=1e-2, weight_decay=0.1, warmup_steps=0)
TRAINED = ModelConfig(
    vocab_size=VOCAB,
    dim=32,
    n_layers=2,
    n_heads=4,
    n_kv_heads=2,
    ffn_dim=64,
    max_seq_len=SEQ,
    explicit_head_dim=16,
    qk_norm=True,
    tie_embeddings=True,
    rope_theta=1e6,
    rope_scaling=RopeScaling("llama3", 4.0, 1.0, 4.0, 8),
)


def _train_batch(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (4, SEQ + 1), generator=torch.Generator().manual_seed(step))


def _train(model: Transformer, rank_slice: Callable[[torch.Tensor], torch.Tensor]) -> list[float]:
    optimizer = build_optimizer(model, TRAIN)
    losses = []
    for step in range(TRAIN.steps):
        batch = rank_slice(_train_batch(step))
        optimizer.zero_grad()
        logits = model(batch[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _train_and_save(root: str, ids: torch.Tensor) -> dict[str, Any]:
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = Transformer(TRAINED)
    layout = build_layout(FSDP_X_TP, "cpu")
    parallelize(model, layout)
    local = _train(model, lambda b: b.chunk(layout.dp_size)[layout.dp_rank])
    # The mean over the data-parallel ranks' batches is the whole batch's loss.
    losses = torch.tensor(local)
    dist.all_reduce(losses)
    losses /= dist.get_world_size()
    path = save_checkpoint(root, TRAIN.steps, model, build_optimizer(model, TRAIN))
    if dist.get_rank() == 0:
        (path / CONFIG_NAME).write_text(json.dumps({"model": TRAINED.to_dict()}))
    with torch.no_grad():
        logits = model(ids)
    return {"losses": losses.tolist(), "logits": logits.detach().clone()}


@pytest.mark.multiprocess
def test_trained_under_fsdp_x_tp_exports_to_transformers(tmp_path: Path) -> None:
    check_model_fits(TRAINED, FSDP_X_TP)
    ids = _ids(2)[:, :SEQ]
    result = run_on_ranks(4, _train_and_save, str(tmp_path / "ckpt"), ids, timeout=300)[0]
    torch.manual_seed(0)
    alone = Transformer(TRAINED)
    # The same steps on one device: the tied weight's two gradients, the q/k norms' and the
    # explicit head width all trained alike (losses near 30, as the tied head multiplies by
    # the N(0, 1) embedding: measured within 1.9e-6 of each other).
    want = _train(alone, lambda b: b)
    assert max(abs(a - b) for a, b in zip(result["losses"], want, strict=True)) < 1e-5
    out = tmp_path / "hf"
    # The checkpoints root: the export takes its latest complete checkpoint.
    assert export_main(["--checkpoint", str(tmp_path / "ckpt"), "--out", str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    assert read_hf_config(out) == TRAINED
    assert _relative(_hf_logits(out, ids), result["logits"]) <= PARALLEL_TOLERANCE


# --- one process: export of each architecture ----------------------------------------------


@pytest.mark.parametrize(
    ("config", "architecture"),
    [
        (ModelConfig(vocab_size=VOCAB, dim=32, n_kv_heads=2, max_seq_len=SEQ), "Llama"),
        (
            ModelConfig(
                vocab_size=VOCAB,
                dim=32,
                qkv_bias=True,
                o_bias=True,
                rope_theta=5e5,
                max_seq_len=SEQ,
            ),
            "Llama",
        ),
        (
            ModelConfig(
                vocab_size=VOCAB,
                dim=32,
                qkv_bias=True,
                tie_embeddings=True,
                rope_scaling=RopeScaling("linear", 4.0),
                max_seq_len=SEQ,
            ),
            "Qwen2",
        ),
    ],
)
def test_export_without_process_group(
    config: ModelConfig, architecture: str, tmp_path: Path
) -> None:
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.3)
            # What a bf16 export keeps: both sides then compute in fp32 from equal weights.
            p.copy_(p.to(torch.bfloat16).float())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    out = export_hf(tmp_path / "step", tmp_path / "hf", config, dtype=torch.bfloat16)
    saved = load_file(out / "model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.bfloat16}
    assert json.loads((out / "config.json").read_text())["architectures"] == [
        f"{architecture}ForCausalLM"
    ]
    assert read_hf_config(out) == config
    ids = _ids()[:, :SEQ]
    with torch.no_grad():
        want = model(ids)
    assert _relative(_hf_logits(out, ids), want) <= ONE_RANK_TOLERANCE


# --- bad inputs ----------------------------------------------------------------------------


def _rewrite(folder: Path, tmp: Path, change: Callable[[dict[str, torch.Tensor]], None]) -> Path:
    out = tmp / "changed"
    out.mkdir()
    (out / "config.json").write_text((folder / "config.json").read_text())
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    return out


def _edited_config(folder: Path, tmp: Path, **changes: Any) -> Path:
    out = tmp / "edited"
    out.mkdir()
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_hub_name_is_refused_with_a_hint(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"'meta-llama/Llama-3.2-1B' is not an existing local.*Hub"
    ):
        read_hf_config("meta-llama/Llama-3.2-1B")
    with pytest.raises(ConfigError, match=r"'Qwen/Qwen3-0.6B' is not an existing local"):
        load_hf_weights(Transformer(ModelConfig()), "Qwen/Qwen3-0.6B")


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"architectures": ["MistralForCausalLM"]},
            r"'MistralForCausalLM'\] is not supported.*Qwen3ForCausalLM",
        ),
        ({"architectures": None, "model_type": "gemma"}, r"model_type 'gemma'.*not supported"),
        (
            {"rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
            r"'yarn' is not supported.*'llama3'",
        ),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_experts": 8}, "num_experts=8 describes MoE"),
        ({"layer_types": ["sliding_attention", "full_attention"]}, "layer_types has"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor=0.5"),
    ],
)
def test_unsupported_configs_name_the_key(
    changes: dict[str, Any], message: str, hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=message):
        read_hf_config(_edited_config(hf_folders["llama"], tmp_path, **changes))


def test_sliding_window_is_refused(hf_folders: dict[str, Path], tmp_path: Path) -> None:
    folder = _edited_config(
        hf_folders["qwen3"],
        tmp_path,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
        layer_types=None,
    )
    with pytest.raises(ConfigError, match="use_sliding_window"):
        read_hf_config(folder)


def _remove_down_proj(t: dict[str, torch.Tensor]) -> None:
    del t["model.layers.1.mlp.down_proj.weight"]


def _add_extra(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.extra.weight"] = torch.zeros(2)


def _reshape_up_proj(t: dict[str, torch.Tensor]) -> None:
    t["model.layers.0.mlp.up_proj.weight"] = torch.zeros(48, 32)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (_remove_down_proj, r"lacks 1 tensor.*model\.layers\.1\.mlp\.down_proj\.weight"),
        (_add_extra, r"model does not: \['model\.layers\.0\.mlp\.extra\.weight'\]"),
        (_reshape_up_proj, r"'model\.layers\.0\.mlp\.up_proj\.weight'.*\(48, 32\).*\(64, 32\)"),
    ],
)
def test_weights_that_do_not_fit_name_the_tensor(
    change: Callable[[dict[str, torch.Tensor]], None],
    message: str,
    hf_folders: dict[str, Path],
    tmp_path: Path,
) -> None:
    folder = _rewrite(hf_folders["llama"], tmp_path, change)
    model = Transformer(read_hf_config(folder))
    with pytest.raises(WeightsMismatchError, match=message):
        load_hf_weights(model, folder)


def test_export_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match="MoE layers"):
        hf_config_dict(ModelConfig(moe=MoEConfig()), torch.float32)
    with pytest.raises(ConfigError, match="attention_bias gives the four"):
        hf_config_dict(ModelConfig(o_bias=True), torch.float32)
    step = tmp_path / "step_000001"
    step.mkdir()
    (step / ".metadata").write_bytes(b"")
    assert export_main(["--checkpoint", str(step), "--out", str(tmp_path / "hf")]) == 2
    assert f"{step / CONFIG_NAME}" in capsys.readouterr().err
    assert export_main(["--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path)]) == 2
    assert "neither a checkpoint step folder" in capsys.readouterr().err


def test_model_config_dict_round_trip_and_unknown_keys() -> None:
    config = ModelConfig(
        moe=MoEConfig(n_experts=8, top_k=2),
        rope_scaling=RopeScaling("llama3", 8.0, 1.0, 4.0, 8192),
        explicit_head_dim=32,
        qkv_bias=True,
    )
    assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    with pytest.raises(ConfigError, match=r"unknown keys \['heads'\]"):
        ModelConfig.from_dict({"heads": 4})
    with pytest.raises(ConfigError, match=r"model\.moe: unknown keys \['experts'\]"):
        ModelConfig.from_dict({"moe": {"experts": 4}})
    with pytest.raises(ConfigError, match=r"model\.dim must be int"):
        ModelConfig.from_dict({"dim": "64"})
    with pytest.raises(ConfigError, match="'ntk' is not supported"):
        RopeScaling("ntk", 2.0)


def test_tied_embeddings_refuse_pipeline_stages() -> None:
    with pytest.raises(ConfigError, match="tie_embeddings with pp=2"):
        check_model_fits(ModelConfig(tie_embeddings=True), ParallelConfig(pp=2))
