"""The rollout engine's batched autoregressive generation with a key/value cache.

:func:`generate` runs hp-train's :class:`~hp_train.model.llama.Transformer` (dense or MoE,
whole or laid out with tensor parallelism by ``hp_dtensor.parallel.parallelize_module`` and
``hp_train.parallel.parallelize.tp_plan``) one token at a time, reusing the model's own
submodules so that tensor parallelism's module hooks do their communication.

Layout of the cache: prompts are *left*-padded to the longest one, so every row writes the
token of step ``t`` into the same cache column ``P + t`` (``P`` the longest prompt); each row
keeps its own positions (``0 .. len - 1`` for its prompt, then ``len + t``), which pick its
rotary angles from ``model.cos`` / ``model.sin``, and an explicit key mask hides its padding
columns. A row's numbers therefore do not depend on the other rows beyond rounding.

MoE feed-forwards: routing is per token (``hp_dtensor.parallel.moe_ops.route``: top-k of each
token's own scores, no expert capacity, no token dropping), so a token's output does not depend
on the other tokens of the batch, and generating token by token computes what the full forward
computes, up to rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from hp_dtensor.watchdog import watch
from hp_rl.sampling import SamplingParams, sample_next
from hp_train.model.llama import Block, Transformer

__all__ = ["Generation", "generate"]


@dataclass(frozen=True)
class Generation:
    """The responses of one :func:`generate` call (``B`` prompts).

    Attributes:
        prompt_lengths: ``[B]`` int64, each prompt's length.
        response: ``[B, N]`` int64, ``N`` the longest response of the batch; ``pad_id`` after
            each row's end.
        response_logprobs: ``[B, N]`` float32, each response token's log-probability (as
            :func:`hp_rl.sampling.sample_next` returns it); 0.0 after each row's end.
        response_lengths: ``[B]`` int64, the stop token counted when one was emitted.
        finished: ``[B]`` bool: the row ended with a stop token (False: it hit
            ``max_new_tokens``).
    """

    prompt_lengths: Tensor
    response: Tensor
    response_logprobs: Tensor
    response_lengths: Tensor
    finished: Tensor


@dataclass
class _Rows:
    """The rows still generating: their index in the batch, first real cache column and cache
    (one ``(keys, values)`` pair per block, ``[rows, local kv heads, columns, head_dim]``)."""

    index: Tensor
    start: Tensor
    cache: list[tuple[Tensor, Tensor]]

    def keep(self, mask: Tensor) -> None:
        # Finished rows leave the batch: they stop changing and cost nothing from here on.
        self.index, self.start = self.index[mask], self.start[mask]
        self.cache = [(k[mask], v[mask]) for k, v in self.cache]


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    # The model's rotary convention ("rotate half"), in the same operation order as the model
    # so that the cached keys equal the full forward's to the last bit.
    half = x.shape[-1] // 2
    swapped = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + swapped * sin


def _heads(t: Tensor, head_dim: int) -> Tensor:
    # [batch, seq, heads * head_dim] -> [batch, heads, seq, head_dim]; under tensor
    # parallelism the width is this rank's heads only, so the count is inferred.
    return t.view(t.shape[0], t.shape[1], -1, head_dim).transpose(1, 2)


def _attention(
    block: Block,
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    rows: _Rows,
    layer: int,
    column: int,
    mask: Tensor,
    columns: int,
) -> Tensor:
    """The attention branch of ``block`` for ``x`` ``[rows, s, dim]`` written at cache columns
    ``column .. column + s - 1`` and attending to columns ``< column + s`` under ``mask``."""
    attn = block.attn
    h = block.attn_norm(x)
    head_dim = attn.head_dim
    q, k = _heads(attn.q_proj(h), head_dim), _heads(attn.k_proj(h), head_dim)
    if attn.q_norm is not None and attn.k_norm is not None:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
    v = _heads(attn.v_proj(h), head_dim)
    if layer == len(rows.cache):
        shape = (k.shape[0], k.shape[1], columns, head_dim)
        rows.cache.append((k.new_zeros(shape), v.new_zeros(shape)))
    keys, values = rows.cache[layer]
    end = column + x.shape[1]
    keys[:, :, column:end] = k
    values[:, :, column:end] = v
    # Grouped-query heads map as in Attention.forward's expand (kv head i serves the query
    # heads i * groups .. (i + 1) * groups - 1, groups = local q heads / local kv heads);
    # enable_gqa does that mapping without copying the whole cache at every step.
    grouped = q.shape[1] != k.shape[1]
    scale = getattr(attn.core, "scale", None)
    out = F.scaled_dot_product_attention(
        q, keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=scale, enable_gqa=grouped
    )
    merged = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
    result: Tensor = attn.o_proj(merged)
    return result


def _forward(
    model: Transformer,
    ids: Tensor,
    positions: Tensor,
    rows: _Rows,
    column: int,
    mask: Tensor,
    columns: int,
) -> Tensor:
    """Logits ``[rows, V]`` of the last of the ``s`` columns of ``ids`` ``[rows, s]`` (at
    ``positions`` ``[rows, s]``), whose keys and values join the cache at ``column``."""
    assert model.tok_embeddings is not None
    assert model.norm is not None
    assert model.output is not None
    cos, sin = model.cos[positions].unsqueeze(1), model.sin[positions].unsqueeze(1)
    x: Tensor = model.tok_embeddings(ids)
    for layer, block in enumerate(model.layers.values()):
        assert isinstance(block, Block)
        x = x + _attention(block, x, cos, sin, rows, layer, column, mask, columns)
        x = x + block.ffn(block.ffn_norm(x))
    # The head on the last column only: the other columns' logits are never used.
    logits: Tensor = model.output(model.norm(x[:, -1:]))
    return logits[:, 0]


def _transformer(model: nn.Module) -> Transformer:
    if not isinstance(model, Transformer):
        raise TypeError(
            f"generate needs an hp_train.model.llama.Transformer, got {type(model).__name__}"
        )
    if model.tok_embeddings is None or model.norm is None or model.output is None:
        raise ValueError(
            "generate needs the whole model (embedding, blocks, final norm and head); got a "
            "pipeline stage without some of them"
        )
    return model


def _prompt_batch(
    model: Transformer, prompts: Sequence[Sequence[int]], params: SamplingParams, pad_id: int
) -> tuple[Tensor, Tensor]:
    """The checked prompts, left-padded: ``(ids [B, P], lengths [B])`` on the model's device."""
    vocab, max_len = model.config.vocab_size, model.config.max_seq_len
    if len(prompts) == 0:
        raise ValueError("prompts must hold at least one prompt, got none")
    if isinstance(pad_id, bool) or not isinstance(pad_id, int) or not 0 <= pad_id < vocab:
        raise ValueError(f"pad_id must be a token id in [0, {vocab}), got {pad_id!r}")
    lengths = [len(p) for p in prompts]
    for i, prompt in enumerate(prompts):
        if not prompt:
            raise ValueError(f"prompt {i} is empty; every prompt needs at least one token")
        if not all(isinstance(t, int) and 0 <= t < vocab for t in prompt):
            raise ValueError(f"prompt {i} has a token outside [0, {vocab}): {list(prompt)}")
    longest = max(lengths)
    # The last generated token is never fed back, so the furthest position fed is
    # len + max_new_tokens - 2.
    if longest + params.max_new_tokens - 1 > max_len:
        raise ValueError(
            f"prompt length {longest} + max_new_tokens {params.max_new_tokens} - 1 exceeds the "
            f"model's max_seq_len {max_len} (its rotary tables); shorten the prompt or lower "
            "max_new_tokens"
        )
    device = model.cos.device
    ids = torch.full((len(prompts), longest), pad_id, dtype=torch.int64)
    for i, prompt in enumerate(prompts):
        ids[i, longest - len(prompt) :] = torch.tensor(list(prompt), dtype=torch.int64)
    return ids.to(device), torch.tensor(lengths, dtype=torch.int64, device=device)


def _check_same_across(group: dist.ProcessGroup, response: Tensor, logprobs: Tensor) -> None:
    """Raise on every rank of ``group`` unless all produced the same tokens and logprobs."""
    mine = torch.stack((response.double(), logprobs.double()))
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    with watch("generate agreement all-gather", group):
        dist.all_gather(gathered, mine, group=group)
    differ = [i for i, other in enumerate(gathered) if not torch.equal(other, gathered[0])]
    if differ:
        raise RuntimeError(
            f"generate: ranks {differ} of the tensor-parallel group produced other tokens or "
            "log-probabilities than its rank 0; seed every rank's generator alike and give "
            "every rank the same prompts and model"
        )


def _prefill(
    transformer: Transformer, ids: Tensor, rows: _Rows, grid: Tensor, columns: int
) -> Tensor:
    """The prompts' forward, filling the cache; the logits of each row's last column.

    Column ``j`` of row ``b`` is position ``j - start[b]``; a query sees the real columns up
    to its own, and a padding query sees itself only (keeps its softmax finite; nothing ever
    attends to it)."""
    longest = ids.shape[1]
    cols = grid[:longest]
    positions = (cols[None, :] - rows.start[:, None]).clamp(min=0)
    real = cols[None, :] >= rows.start[:, None]
    causal = cols[None, :] <= cols[:, None]
    eye = torch.eye(longest, dtype=torch.bool, device=ids.device)
    mask = (causal[None] & real[:, None, :]) | eye
    return _forward(transformer, ids, positions, rows, 0, mask[:, None], columns)


def _decode_step(
    transformer: Transformer,
    tokens: Tensor,
    stopped: Tensor,
    rows: _Rows,
    grid: Tensor,
    column: int,
    columns: int,
) -> Tensor:
    """Drop the rows that just stopped, then feed every other row its newest token (cache
    column ``column``); the logits of the next token."""
    going = ~stopped
    if not bool(going.all()):
        rows.keep(going)
        tokens = tokens[going]
    positions = (column - rows.start)[:, None]
    mask = (grid[None, : column + 1] >= rows.start[:, None])[:, None, None, :]
    return _forward(transformer, tokens[:, None], positions, rows, column, mask, columns)


@torch.no_grad()
def generate(
    model: nn.Module,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    generator: torch.Generator,
    *,
    pad_id: int,
    group: dist.ProcessGroup | None = None,
) -> Generation:
    """Generate a response to each of ``prompts`` with ``model`` (batched, with a KV cache).

    All prompts are prefilled in one forward; then every unfinished row gets one token per
    step (:func:`hp_rl.sampling.sample_next` with ``params`` and ``generator``). A row ends
    after it emits one of ``params.stop_tokens`` or after ``params.max_new_tokens`` tokens;
    finished rows leave the batch and stop changing; generation stops when every row has
    finished or at ``max_new_tokens``. The computation is the model's eval-mode forward
    (no dropout), through its own submodules (``tok_embeddings``, each block's
    ``attn_norm``, ``attn.q_proj`` / ``k_proj`` / ``v_proj``, ``q_norm`` / ``k_norm``,
    ``o_proj``, ``ffn_norm``, ``ffn``, then ``norm`` and ``output``), with
    ``scaled_dot_product_attention`` over the cache under an explicit mask (grouped-query
    heads mapped as ``Attention.forward`` maps them).

    Tensor parallelism: every rank of the group must pass the same prompts and a generator
    seeded alike (the logits are gathered, so all ranks then draw the same tokens). Pass the
    tensor-parallel ``group`` to check it: at the end the ranks compare their tokens and
    log-probabilities (one all-gather) and all raise if any differs.

    Args:
        model: an :class:`hp_train.model.llama.Transformer`, whole or tensor-parallel (not
            FSDP-sharded: its submodules are called directly).
        prompts: ``B`` non-empty lists of token ids; lengths may differ.
        params: sampling settings.
        generator: the random source of the draws (on the model's device).
        pad_id: the token id written after each row's end (also fed in the prompts'
            padding, which the mask hides); a valid token id.
        group: the tensor-parallel process group to check agreement over, or None.

    Raises:
        TypeError: ``model`` is no hp-train Transformer.
        ValueError: a pipeline stage, no prompts, an empty prompt, a token or ``pad_id``
            outside the vocabulary, or a prompt too long for ``max_seq_len`` with
            ``max_new_tokens``.
        RuntimeError: ranks of ``group`` produced different tokens.
    """
    transformer = _transformer(model)
    ids, lengths = _prompt_batch(transformer, prompts, params, pad_id)
    batch, longest = ids.shape
    device = ids.device
    steps = params.max_new_tokens
    columns = longest + steps - 1
    response = torch.full((batch, steps), pad_id, dtype=torch.int64, device=device)
    logprobs = torch.zeros((batch, steps), dtype=torch.float32, device=device)
    produced = torch.zeros(batch, dtype=torch.int64, device=device)
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    rows = _Rows(torch.arange(batch, device=device), longest - lengths, [])
    grid = torch.arange(columns, device=device)
    logits = _prefill(transformer, ids, rows, grid, columns)
    stops = torch.tensor(params.stop_tokens, dtype=torch.int64, device=device)
    for step in range(steps):
        tokens, chosen = sample_next(logits, params, generator)
        response[rows.index, step] = tokens
        logprobs[rows.index, step] = chosen
        produced[rows.index] += 1
        stopped = torch.isin(tokens, stops)
        finished[rows.index[stopped]] = True
        if step == steps - 1 or bool(stopped.all()):
            break
        logits = _decode_step(transformer, tokens, stopped, rows, grid, longest + step, columns)
    if group is not None:
        _check_same_across(group, response, logprobs)
    width = int(produced.max())
    return Generation(
        prompt_lengths=lengths,
        response=response[:, :width].contiguous(),
        response_logprobs=logprobs[:, :width].contiguous(),
        response_lengths=produced,
        finished=finished,
    )
