"""The `tp` forward layout: each rank keeps its slice of every large weight, and only activations move.

Column-parallel weights (q/k/v, gate/up, the embedding and lm_head) keep a range of output rows,
row-parallel ones (o_proj, down_proj) a range of input columns; norms and rotary buffers stay
whole on every rank. A forward then exchanges activations only: one all-reduce after each
row-parallel layer, one after the vocab-parallel embedding, and one all-gather of the logits,
so every rank gets the full logits and `generate` (with `synced_gpus`) picks the same token on
every rank. No weight is ever gathered: a layer costs two all-reduces of the hidden state
instead of an all-gather of its weights.

The model stays the transformers model users know: the sliced layers keep their names and
hooks and are only given a forward of their own (their class becomes a subclass of theirs), and
attention modules get their local number of query heads per KV head. Parameters are plain local
tensors (DTensor's dispatch would double the per-token cost on CPU, and its even `torch.chunk`
split cannot express the uneven head split); each carries a `TPShard` saying which rows or
columns of which global shape it holds, on every rank.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from shardbook.rankd.parallel.expert_parallel import ExpertLayout, apply_moe, moe_plan
from shardbook.rankd.parallel.head_split import HeadShare, balanced_ranges, split_heads, split_mlp_rows
from shardbook.rankd.parallel.tp_modules import (
    RowParallelLinear,
    TPShard,
    VocabGatheredLinear,
    VocabParallelEmbedding,
    become,
)

SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "glm4_moe")
"""Families whose decoder layers `plan_tp` knows: Llama (SmolLM2 too), Qwen2 (qkv bias), Qwen3 (q/k norm), and the
mixture-of-experts families Qwen2-MoE (shared expert), Qwen3-MoE, Mixtral and GLM-4-MoE (shared experts, dense
first layers), whose experts go expert-parallel (`expert_parallel`)."""


def tp_unavailable(hf_config, parts: int) -> str | None:
    """Why `tp` cannot run this model over `parts` ranks (a message naming what to do), or None when it can."""
    config = hf_config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"parallel.decode tp does not support {model_type!r} models yet (it supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}): use parallel.decode gather (each rank keeps the whole model "
            "after the first forward) or reshard (gathers each layer for every token; least memory)"
        )
    try:
        split_heads(config.num_attention_heads, config.num_key_value_heads, parts)
    except ValueError as e:
        return str(e)
    return None


def shard_tp(model: nn.Module, mesh: DeviceMesh, experts: ExpertLayout | None, expert_group) -> dict[str, TPShard]:
    """Lay `model` (still on meta) out for `tp` over the mesh's shard axis; every sliced parameter's `TPShard`."""
    group, rank = mesh.get_group("shard"), mesh.get_local_rank("shard")
    plan = plan_tp(model, dist.get_world_size(group), experts)
    _apply_tp(model, group, rank, experts, expert_group)
    return plan


def plan_tp(model: nn.Module, parts: int, experts: ExpertLayout | None = None) -> dict[str, TPShard]:
    """The `TPShard` of every sliced parameter of `model`, by parameter name."""

    config = model.config.get_text_config()
    plan: dict[str, TPShard] = {}
    embedding = model.get_input_embeddings().weight.shape
    vocab = TPShard.along(embedding, 0, [(r,) for r in balanced_ranges(embedding[0], parts)])
    plan["model.embed_tokens.weight"] = vocab
    if "lm_head.weight" in dict(model.named_parameters(remove_duplicate=False)):
        plan["lm_head.weight"] = vocab
    shares = split_heads(config.num_attention_heads, config.num_key_value_heads, parts)
    for index, layer in enumerate(model.model.layers):
        prefix = f"model.layers.{index}"
        moe = hasattr(layer.mlp, "experts")
        plan.update(_layer_plan(prefix, layer, config, shares, dense_mlp=not moe))
        if moe:
            plan.update(moe_plan(f"{prefix}.mlp", layer.mlp, experts))
    return plan


def _layer_plan(prefix: str, layer: nn.Module, config, shares: list[HeadShare], dense_mlp: bool) -> dict[str, TPShard]:
    """Attention sliced by heads, and a dense MLP by rows that even out the weights per rank."""
    attn, mlp = layer.self_attn, layer.mlp
    head_dim = attn.head_dim
    query_rows = [(_scaled(s.query_heads, head_dim),) for s in shares]
    kv_rows = [_kv_pieces(s, head_dim) for s in shares]
    hidden = config.hidden_size
    attention_units = [2 * hidden * head_dim * (len(s.query_heads) + len(s.kv_heads)) for s in shares]
    slices = [
        ("self_attn.q_proj", attn.q_proj, 0, query_rows),
        ("self_attn.k_proj", attn.k_proj, 0, kv_rows),
        ("self_attn.v_proj", attn.v_proj, 0, kv_rows),
        ("self_attn.o_proj", attn.o_proj, 1, query_rows),
    ]
    if dense_mlp:
        mlp_rows = [(rows,) for rows in split_mlp_rows(mlp.gate_proj.out_features, attention_units, hidden)]
        slices += [
            ("mlp.gate_proj", mlp.gate_proj, 0, mlp_rows),
            ("mlp.up_proj", mlp.up_proj, 0, mlp_rows),
            ("mlp.down_proj", mlp.down_proj, 1, mlp_rows),
        ]
    plan = {}
    for name, module, dim, pieces in slices:
        plan[f"{prefix}.{name}.weight"] = TPShard.along(module.weight.shape, dim, pieces)
        if module.bias is not None and dim == 0:  # a row-parallel bias is added once, after the sum
            plan[f"{prefix}.{name}.bias"] = TPShard.along(module.bias.shape, 0, pieces)
    return plan


def _scaled(heads: range, head_dim: int) -> range:
    return range(heads.start * head_dim, heads.stop * head_dim)


def _kv_pieces(share: HeadShare, head_dim: int) -> tuple[range, ...]:
    """The rows of the KV heads `share` stores, consecutive heads merged into one range."""
    pieces: list[range] = []
    for head in share.kv_heads:
        rows = range(head * head_dim, (head + 1) * head_dim)
        if pieces and pieces[-1].stop == rows.start:
            pieces[-1] = range(pieces[-1].start, rows.stop)
        else:
            pieces.append(rows)
    return tuple(pieces)


def _apply_tp(model: nn.Module, group: dist.ProcessGroup, rank: int, experts, expert_group) -> None:
    """Give the sliced layers their forwards and attention its local head counts (before the weights are read)."""

    config = model.config.get_text_config()
    parts = dist.get_world_size(group)
    shares = split_heads(config.num_attention_heads, config.num_key_value_heads, parts)
    vocab = balanced_ranges(model.get_input_embeddings().weight.shape[0], parts)
    become(model.get_input_embeddings(), VocabParallelEmbedding, group, vocab_start=vocab[rank].start)
    if model.get_output_embeddings() is not None:
        become(model.get_output_embeddings(), VocabGatheredLinear, group, vocab_sizes=[len(r) for r in vocab])
    for layer in model.model.layers:
        layer.self_attn.num_key_value_groups = shares[rank].groups
        become(layer.self_attn.o_proj, RowParallelLinear, group)
        if hasattr(layer.mlp, "experts"):
            apply_moe(layer.mlp, experts, rank, group, expert_group)
        else:
            become(layer.mlp.down_proj, RowParallelLinear, group)
