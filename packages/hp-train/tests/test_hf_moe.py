"""Qwen3-MoE and Mixtral checkpoints in and out of hp-train, against ``transformers`` itself.

Tiny random models (2 layers, 4 experts, top-2, hidden 32, vocab 128 or 256), fp32, saved
with ``save_pretrained`` (one tensor per expert, the files of the Hub) and, for the fused
layout Transformers 5's models hold (``gate_up_proj`` ``[E, 2 * hidden, dim]``,
``down_proj`` ``[E, dim, hidden]``), as the model's own state dict, which ``from_pretrained``
reads as it is:

* ``qwen3_moe``: Qwen3-MoE with q/k norms, an explicit head width 16 != 32 / 4, attention
  biases, renormalized top-k (``norm_topk_prob``), every layer MoE;
* ``qwen3_moe_sparse``: Qwen3-MoE whose layer 0 is dense (``mlp_only_layers=[0]``, so
  hp-train's ``moe_every`` is 2), top-k weights not renormalized;
* ``mixtral``: Mixtral (Llama's attention, renormalized top-2, every layer MoE).

Norm weights and biases are drawn at random too (``transformers`` initializes them to ones
and zeros, which would hide a mix-up).

Routing near a tie could send a token to another expert in the two programs (their sums run
in other orders, ~1e-7 apart), so every comparison first checks, on ``transformers``' router
logits, that the k-th and (k+1)-th largest probabilities of every token and MoE layer are at
least :data:`MARGIN` apart (the seeds and inputs below give 4.4e-4 and more, against
differences near 1e-7).

Tolerances, relative to the largest logit, as ``test_hf_interop.py``'s: hp-train's grouped
experts sum each token's expert outputs in another order than ``transformers``' loop over
experts, so one rank is not bit-equal as the dense models are (measured <= 2.7e-7, the export
<= 4.1e-7; bound 1e-6); under FSDP x EP x TP the row-wise projections and the experts' token
exchange add other orders (measured <= 6.9e-7; bound 4e-6).
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
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save
from torch.distributed.tensor import DTensor

from hp_testing import run_on_ranks
from hp_train.checkpoint.export import main as export_main
from hp_train.checkpoint.hf.export import export_hf
from hp_train.checkpoint.hf.hf_config import hf_config_dict, read_hf_config
from hp_train.checkpoint.hf.load import WeightsMismatchError, load_hf_weights
from hp_train.checkpoint.hf.safetensors_index import SafetensorsCheckpoint
from hp_train.config.cli import parse
from hp_train.config.schema import ConfigError, ModelConfig, MoEConfig, ParallelConfig
from hp_train.data.loader import DataSpec, build_data
from hp_train.data.tokenizer import ByteTokenizer
from hp_train.model.llama import Transformer
from hp_train.parallel.parallelize import build_layout, parallelize
from hp_train.runtime import init_runtime
from hp_train.trainer import train

VOCAB, SEQ, BATCH = 128, 16, 2
ONE_RANK_TOLERANCE = 1e-6
PARALLEL_TOLERANCE = 4e-6
MARGIN = 1e-4
# World 4: FSDP x EP x TP (experts split over ep and their hidden dim over tp), and FSDP x EP
# (FSDP shards each expert group's stacks over the 2 ranks that hold the same experts).
LAYOUTS = {
    "dp2_tp2_ep2_etp": ParallelConfig(dp_shard=2, tp=2, ep=2, ep_tp=True),
    "dp4_ep2": ParallelConfig(dp_shard=4, ep=2),
}

_COMMON: dict[str, Any] = {
    "vocab_size": VOCAB,
    "hidden_size": 32,
    "intermediate_size": 48,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "rms_norm_eps": 1e-5,
    "initializer_range": 0.2,
    "num_experts_per_tok": 2,
    "attn_implementation": "sdpa",
}
# Class names in transformers (imported where used: the rank processes need none).
KINDS: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen3_moe": (
        "Qwen3Moe",
        {
            "num_experts": 4,
            "moe_intermediate_size": 24,
            "norm_topk_prob": True,
            "head_dim": 16,
            "attention_bias": True,
            "rope_parameters": {"rope_type": "default", "rope_theta": 20000.0},
        },
    ),
    "qwen3_moe_sparse": (
        "Qwen3Moe",
        {"num_experts": 4, "moe_intermediate_size": 24, "mlp_only_layers": [0]},
    ),
    "mixtral": ("Mixtral", {"num_local_experts": 4}),
}


def _hf_model(kind: str, vocab: int = VOCAB, seed: int = 0) -> nn.Module:
    import transformers

    prefix, extra = KINDS[kind]
    config = getattr(transformers, f"{prefix}Config")(**{**_COMMON, "vocab_size": vocab}, **extra)
    torch.manual_seed(seed)
    model: nn.Module = getattr(transformers, f"{prefix}ForCausalLM")(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                p.normal_(0.0, 0.2)
    return model


def _save(model: Any, folder: Path, layout: str) -> Path:
    if layout == "per_expert":
        model.save_pretrained(folder)
        return folder
    # The fused layout: the Transformers 5 model's own parameters, stored as they are.
    folder.mkdir(parents=True)
    model.config.save_pretrained(folder)
    tensors = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def hf_folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf_moe")
    folders = {}
    for kind in KINDS:
        model = _hf_model(kind)
        for layout in ("per_expert", "fused"):
            folders[f"{kind}-{layout}"] = _save(model, root / f"{kind}-{layout}", layout)
    return folders


def _ids(seed: int = 1, vocab: int = VOCAB) -> torch.Tensor:
    return torch.randint(0, vocab, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def _hf(folder: Path) -> Any:
    import transformers

    model: Any = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    return model


def _hf_logits(folder: Path, ids: torch.Tensor, *, compared: bool = True) -> torch.Tensor:
    """transformers' logits of ``ids``, after checking that no routing is near a tie if they
    are ``compared`` with hp-train's."""
    model = _hf(folder)
    with torch.no_grad():
        out = model(input_ids=ids, output_router_logits=True)
    k = model.config.num_experts_per_tok
    for layer in out.router_logits if compared else ():
        top = torch.softmax(layer.float(), dim=-1).topk(k + 1, dim=-1).values
        assert float((top[:, k - 1] - top[:, k]).min()) >= MARGIN, "routing near a tie"
    logits: torch.Tensor = out.logits
    return logits


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).abs().max() / want.abs().max())


# --- configuration --------------------------------------------------------------------------


def _edited(
    folder: Path, tmp: Path, *, drop: tuple[str, ...] = (), name: str = "edited", **changes: Any
) -> Path:
    out = tmp / name
    out.mkdir(exist_ok=True)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(changes)
    for key in drop:
        del raw[key]
    (out / "config.json").write_text(json.dumps(raw))
    return out


def test_read_hf_config_maps_the_moe_keys(hf_folders: dict[str, Path]) -> None:
    qwen = read_hf_config(hf_folders["qwen3_moe-per_expert"])
    assert qwen.moe == MoEConfig(
        n_experts=4,
        top_k=2,
        expert_ffn_dim=24,
        every=1,
        n_shared_experts=0,
        # output_router_logits is false: transformers adds no load-balancing loss.
        aux_loss_weight=0.0,
        normalize_topk=True,
    )
    assert (qwen.qk_norm, qwen.head_dim, qwen.qkv_bias, qwen.o_bias) == (True, 16, True, True)
    assert (qwen.ffn_dim, qwen.rope_theta, qwen.norm_eps) == (48, 20000.0, 1e-5)
    sparse = read_hf_config(hf_folders["qwen3_moe_sparse-per_expert"])
    assert sparse.moe is not None
    assert (sparse.moe.every, sparse.moe.normalize_topk, sparse.head_dim) == (2, False, 8)
    assert [sparse.moe.is_moe_layer(i) for i in range(2)] == [False, True]
    mixtral = read_hf_config(hf_folders["mixtral-fused"])
    assert mixtral.moe is not None
    assert (mixtral.moe.n_experts, mixtral.moe.expert_ffn_dim, mixtral.moe.every) == (4, 48, 1)
    assert mixtral.moe.normalize_topk
    # Mixtral's config class defaults: rope_theta 1e6, no q/k norms, no biases.
    assert (mixtral.rope_theta, mixtral.qk_norm, mixtral.qkv_bias) == (1e6, False, False)
    for config in (qwen, sparse, mixtral):
        assert ModelConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config


# Keys a config.json may lack, which then mean what transformers' config class defaults them to.
_DEFAULTED = {
    "qwen3_moe": (
        "num_local_experts", "num_experts_per_tok", "moe_intermediate_size",
        "decoder_sparse_step", "norm_topk_prob", "rope_parameters", "rms_norm_eps",
        "max_position_embeddings", "head_dim",
    ),
    "mixtral": (
        "num_local_experts", "num_experts_per_tok", "rope_parameters", "rms_norm_eps",
        "max_position_embeddings", "head_dim",
    ),
}  # fmt: skip


@pytest.mark.parametrize("kind", list(_DEFAULTED))
def test_absent_keys_take_transformers_defaults(
    kind: str, hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    import transformers

    present = set(json.loads((hf_folders[f"{kind}-per_expert"] / "config.json").read_text()))
    folder = _edited(
        hf_folders[f"{kind}-per_expert"],
        tmp_path,
        drop=tuple(k for k in _DEFAULTED[kind] if k in present),
    )
    got = read_hf_config(folder, max_seq_len=SEQ)
    want: Any = transformers.AutoConfig.from_pretrained(folder)
    assert got.moe is not None
    assert got.moe.n_experts == want.num_local_experts
    assert got.moe.top_k == want.num_experts_per_tok
    assert got.rope_theta == want.rope_parameters["rope_theta"]
    assert got.norm_eps == want.rms_norm_eps
    # Both attention classes fall back to hidden_size / num_attention_heads.
    assert got.head_dim == (getattr(want, "head_dim", None) or 32 // 4)
    if kind == "qwen3_moe":
        assert got.moe.expert_ffn_dim == want.moe_intermediate_size
        assert got.moe.normalize_topk == want.norm_topk_prob
        assert got.moe.every == want.decoder_sparse_step


@pytest.mark.parametrize(
    ("kind", "changes", "message"),
    [
        ("mixtral", {"sliding_window": 8}, r"sliding_window=8 gives Mixtral's attention"),
        ("mixtral", {"router_jitter_noise": 0.1}, r"router_jitter_noise=0.1 multiplies"),
        (
            "qwen3_moe",
            {"use_sliding_window": True, "sliding_window": 8},
            r"use_sliding_window=true gives Qwen3-MoE's attention a sliding window of 8",
        ),
        (
            "qwen3_moe",
            {"mlp_only_layers": [1]},
            r"mlp_only_layers=\[1\] with decoder_sparse_step=1 makes layers \[0\] MoE, which "
            r"hp-train's moe_every",
        ),
        ("qwen3_moe", {"decoder_sparse_step": 3}, r"decoder_sparse_step=3 .* leaves no MoE"),
        ("qwen3_moe", {"num_local_experts": 0}, r"num_local_experts=0 leaves no MoE layer"),
        (
            "qwen3_moe",
            {"num_experts": 8},
            r"\{'num_experts': 8, 'num_local_experts': 4\} disagree",
        ),
        ("qwen3_moe", {"norm_topk_prob": "yes"}, r"norm_topk_prob must be true or false"),
        ("mixtral", {"num_experts_per_tok": 5}, r"moe.top_k=5 exceeds moe.n_experts=4"),
    ],
)
def test_what_hp_train_cannot_express_is_refused_naming_the_key(
    kind: str, changes: dict[str, Any], message: str, hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = _edited(hf_folders[f"{kind}-per_expert"], tmp_path, **changes)
    with pytest.raises(ConfigError, match=message):
        read_hf_config(folder)


def test_export_refuses_moe_models_no_architecture_holds() -> None:
    qwen = ModelConfig(qk_norm=True, moe=MoEConfig(n_shared_experts=1))
    with pytest.raises(ConfigError, match="n_shared_experts=1: neither Qwen3-MoE nor Mixtral"):
        hf_config_dict(qwen, torch.float32)
    plain = ModelConfig(moe=MoEConfig(every=2, normalize_topk=False))
    with pytest.raises(ConfigError, match=r"not renormalized .*dense layers \(moe.every=2\)"):
        hf_config_dict(plain, torch.float32)
    with pytest.raises(ConfigError, match=r"none of attention biases"):
        hf_config_dict(
            ModelConfig(qkv_bias=True, moe=MoEConfig(every=1, normalize_topk=True)), torch.float32
        )


def test_a_checkpoint_missing_an_expert_is_named(
    hf_folders: dict[str, Path], tmp_path: Path
) -> None:
    folder = hf_folders["mixtral-per_expert"]
    out = _edited(folder, tmp_path)
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.block_sparse_moe.experts.3.w2.weight"]
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(WeightsMismatchError, match=r"experts\.3\.w2\.weight"):
        load_hf_weights(Transformer(read_hf_config(out)), out)


# --- one rank -------------------------------------------------------------------------------


@pytest.mark.parametrize("layout", ["per_expert", "fused"])
@pytest.mark.parametrize("kind", list(KINDS))
def test_one_rank_logits_equal_transformers(
    kind: str, layout: str, hf_folders: dict[str, Path]
) -> None:
    folder = hf_folders[f"{kind}-{layout}"]
    model = Transformer(read_hf_config(folder))
    load_hf_weights(model, folder)
    ids = _ids()
    with torch.no_grad():
        got = model(ids)
    # Measured 2.7e-7 (qwen3_moe), 1.2e-7 (sparse), 2.6e-7 (mixtral), in both layouts.
    assert _relative(got, _hf_logits(folder, ids)) <= ONE_RANK_TOLERANCE


# --- world 4: FSDP x EP x TP ----------------------------------------------------------------


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


def _held(model: nn.Module) -> tuple[dict[str, int], set[tuple[int, int]]]:
    """Elements of each tensor this rank holds, and its (layer, expert) pairs of ``w1``."""
    elements, experts = {}, set()
    for name, value in model.state_dict().items():
        assert isinstance(value, DTensor)
        elements[name] = value.to_local().numel()
        if name.endswith("experts.w1") and value.to_local().numel():
            (chunk,) = value.__create_chunk_list__()
            first, count = chunk.offsets[0], chunk.sizes[0]
            experts |= {(int(name.split(".")[1]), e) for e in range(first, first + count)}
    return elements, experts


def _load_laid_out(runs: list[tuple[str, str]], ids: torch.Tensor) -> list[dict[str, Any]]:
    torch.set_num_threads(1)
    results = []
    layouts = {name: build_layout(parallel, "cpu") for name, parallel in LAYOUTS.items()}
    for name, folder in runs:
        torch.manual_seed(123)  # any values: the checkpoint must replace them all
        model = Transformer(read_hf_config(folder))
        parallelize(model, layouts[name])
        local, experts = _held(model)
        counts, undo = _counting_reads()
        try:
            load_hf_weights(model, folder)
        finally:
            undo()
        with torch.no_grad():
            logits = model(ids)
        results.append(
            {
                "layout": name,
                "folder": folder,
                "logits": logits.detach().clone(),
                "read": counts,
                "held": local,
                "experts": experts,
            }
        )
    return results


# Each layout with each family and each expert layout once.
LAID_OUT = [
    ("dp2_tp2_ep2_etp", "qwen3_moe-per_expert"),
    ("dp2_tp2_ep2_etp", "mixtral-fused"),
    ("dp4_ep2", "qwen3_moe-fused"),
    ("dp4_ep2", "mixtral-per_expert"),
]


@pytest.mark.multiprocess
def test_fsdp_x_ep_x_tp_load_reads_own_pieces_and_gives_transformers_logits(
    hf_folders: dict[str, Path],
) -> None:
    ids = _ids()
    want = {n: _hf_logits(hf_folders[n], ids) for n in {n for _, n in LAID_OUT}}
    runs = [(layout, str(hf_folders[n])) for layout, n in LAID_OUT]
    per_rank = run_on_ranks(4, _load_laid_out, runs, ids, timeout=300)
    for i, (layout, name) in enumerate(LAID_OUT):
        stored = load_file(hf_folders[name] / "model.safetensors")
        for rank, results in enumerate(per_rank):
            got, where = results[i], (layout, name, rank)
            # Measured 3.7e-7 and 6.9e-7 (FSDP x EP x TP), 2.7e-7 and 2.6e-7 (FSDP x EP).
            assert _relative(got["logits"], want[name]) <= PARALLEL_TOLERANCE, where
            # Exactly the elements this rank holds, no more: of a fused gate_up_proj only its
            # w1 and w3 rows.
            assert sum(got["read"].values()) == sum(got["held"].values()), where
            if name.endswith("per_expert"):
                # Only the files of the experts this rank holds.
                read = {
                    (int(k.split(".")[2]), int(k.split(".")[5]))
                    for k in got["read"]
                    if ".experts." in k
                }
                assert read == got["experts"], where
                assert len(read) < 2 * 4, where  # a part of the 2 layers x 4 experts
        assert set().union(*(results[i]["read"] for results in per_rank)) == set(stored), name


# --- world 4: the command line, one step, then the export ----------------------------------

CLI_VOCAB, CLI_BATCH = 256, 4
# Losses near 5.5 (bytes, a random model); as test_init_from_cli.py's bound.
LOSS_TOLERANCE = 5e-6
CLI_ARGS = [
    "--dp-shard", "2", "--tp", "2", "--ep", "2", "--ep-tp", "--optimizer", "adamw",
    "--steps", "1", "--checkpoint-every", "1", "--data", "pydoc", "--eval-fraction", "0.1",
    "--eval-every", "1", "--eval-batches", "2", "--seq-len", str(SEQ),
    "--global-batch", str(CLI_BATCH), "--quiet",
]  # fmt: skip


def _run(argv: list[str]) -> dict[str, Any]:
    runtime = init_runtime("cpu", threads=1)
    model, parallel, config, options, _ = parse(argv, dist.get_world_size())
    summary = train(model, parallel, config, options, runtime)
    return {"losses": summary.losses, "eval": summary.eval_losses}


def _hf_loss(
    folder: Path, inputs: torch.Tensor, targets: torch.Tensor, *, compared: bool = True
) -> float:
    logits = _hf_logits(folder, inputs, compared=compared)
    return float(F.cross_entropy(logits.flatten(0, 1), targets.flatten()))


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["qwen3_moe", "mixtral"])
def test_init_from_moe_trains_under_fsdp_x_ep_x_tp_and_exports(kind: str, tmp_path: Path) -> None:
    source = _hf_model(kind, vocab=CLI_VOCAB)
    folder = _save(source, tmp_path / kind, "per_expert")
    out = tmp_path / "run"
    argv = [*CLI_ARGS, "--init-from", str(folder), "--out", str(out)]
    result = run_on_ranks(4, _run, argv, timeout=300)[0]
    data = build_data(
        DataSpec(source="pydoc", eval_fraction=0.1), ByteTokenizer(), seq_len=SEQ, seed=0
    )
    first = data.batch(0, CLI_BATCH, 0, 1)
    # Measured 2.4e-7 apart for both (losses 5.89 and 6.22).
    assert abs(result["losses"][0] - _hf_loss(folder, first.inputs, first.targets)) <= (
        LOSS_TOLERANCE
    )
    exported = tmp_path / "exported"
    assert export_main(["--checkpoint", str(out / "checkpoints"), "--out", str(exported)]) == 0
    held_out = data.eval_batches(CLI_BATCH, 0, 1, 2)
    want_eval = sum(_hf_loss(exported, b.inputs, b.targets) for b in held_out) / len(held_out)
    # Measured 2.4e-7 (qwen3_moe) and 1.2e-7 (mixtral).
    assert abs(result["eval"][0] - want_eval) <= LOSS_TOLERANCE
    # Trained: the exported weights are not the initial ones.
    initial = _hf_loss(folder, held_out[0].inputs, held_out[0].targets, compared=False)
    assert abs(initial - want_eval) > 1e-4


# --- one process: export -------------------------------------------------------------------

_SHAPE: dict[str, Any] = {
    "vocab_size": VOCAB,
    "dim": 32,
    "n_layers": 2,
    "n_heads": 4,
    "n_kv_heads": 2,
    "ffn_dim": 48,
    "max_seq_len": SEQ,
}
# Qwen3-MoE: q/k norms, a dense layer 0, renormalized top-k, an auxiliary loss (exported as
# output_router_logits=true); Mixtral: every layer MoE, renormalized top-2.
EXPORTED: dict[str, tuple[dict[str, Any], dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": (
        {"explicit_head_dim": 16, "qk_norm": True},
        {"expert_ffn_dim": 24, "every": 2, "aux_loss_weight": 0.01, "normalize_topk": True},
    ),
    "MixtralForCausalLM": (
        {"rope_theta": 1e6},
        {"expert_ffn_dim": 48, "every": 1, "aux_loss_weight": 0.0, "normalize_topk": True},
    ),
}


@pytest.mark.parametrize("architecture", list(EXPORTED))
def test_export_loads_in_transformers_with_hp_trains_logits(
    architecture: str, tmp_path: Path
) -> None:
    model_keys, moe_keys = EXPORTED[architecture]
    moe = MoEConfig(n_experts=4, top_k=2, **moe_keys)
    config = ModelConfig(**_SHAPE, **model_keys, moe=moe)
    torch.manual_seed(0)
    model = Transformer(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.2)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp_save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "step"), no_dist=True)
    out = export_hf(tmp_path / "step", tmp_path / "hf", config)
    assert json.loads((out / "config.json").read_text())["architectures"] == [architecture]
    assert read_hf_config(out) == config
    ids = _ids()
    with torch.no_grad():
        want = model(ids)
    # Measured 1.2e-7 (Qwen3-MoE), 4.1e-7 (Mixtral).
    assert _relative(_hf_logits(out, ids), want) <= ONE_RANK_TOLERANCE
    # What transformers itself writes for the model it loaded: the same tensors, by name.
    again = tmp_path / "resaved"
    _hf(out).save_pretrained(again)
    written, resaved = load_file(out / "model.safetensors"), load_file(again / "model.safetensors")
    assert set(written) == set(resaved)
    assert all(torch.equal(written[k], resaved[k]) for k in written)
