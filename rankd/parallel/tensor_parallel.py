"""The `tp` forward layout: each rank keeps its slice of every large weight, and only activations move.

Column-parallel weights (q/k/v, gate/up, the embedding and lm_head) keep a range of output rows,
row-parallel ones (o_proj, down_proj) a range of input columns; norms and rotary buffers stay
whole on every rank. A forward then exchanges activations only: one all-reduce after each
row-parallel layer, one after the vocab-parallel embedding, and one all-gather of the logits,
so every rank gets the full logits and `generate` (with `synced_gpus`) picks the same token on
every rank. No weight is ever gathered: a layer costs two all-reduces of the hidden state
instead of an all-gather of its weights.

Which modules are split comes from the plans transformers declares for the model class
(`declared_plans`: `base_model_tp_plan`, `base_model_ep_plan`, the LM class's `_tp_plan`);
how their rows go to the ranks (whole heads, uneven splits) from `attention_split`,
`head_split` and `expert_parallel`. Modules no plan names stay whole on every rank.

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

from shardbook.rankd.parallel.attention_split import AttentionSplit, attention_modules
from shardbook.rankd.parallel.biased_experts import apply_biased_experts, biased_experts_plan, has_expert_biases
from shardbook.rankd.parallel.declared_plans import (
    COLUMN,
    EXPERTS,
    ROW,
    VOCAB,
    has_declared_plan,
    module_plan,
    unknown_words,
)
from shardbook.rankd.parallel.expert_parallel import ExpertLayout, apply_experts, experts_plan
from shardbook.rankd.parallel.head_split import balanced_ranges, split_mlp_rows
from shardbook.rankd.parallel.moe_block import maybe_fold_shared_experts
from shardbook.rankd.parallel.tp_modules import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    VocabGatheredLinear,
    VocabParallelEmbedding,
    become,
    become_split_input,
)

SUPPORTED_MODEL_TYPES = (
    "llama",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "glm4_moe",
    "glm_moe_dsa",
    "deepseek_v3",
    "deepseek_v32",
    "gpt_oss",
    "qwen3_next",
    "minimax_m2",
    "longcat_flash",
    "deepseek_v4",
)
"""Families whose declared plans `tp` has been checked against one process (tests/multiproc): Llama (SmolLM2 too),
Qwen2 (qkv bias), Qwen3 (q/k norm), the mixture-of-experts families Qwen2-MoE (shared expert), Qwen3-MoE, Mixtral
and GLM-4-MoE (shared experts, dense first layers), and the MLA ones: GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 with
their sparse-attention indexer, DeepSeek-V3; GPT-OSS (attention sinks, expert biases), Qwen3-Next (gated attention
split by heads, Gated DeltaNet layers whole), MiniMax-M2 (attention whole: its q/k norms span all heads) and
LongCat-Flash (two MLAs and two MLPs per layer, zero-compute experts); DeepSeek-V4 (attention with its compressor,
indexer and grouped output LoRA, and the hyper-connections, whole on every rank; routed and shared experts split)."""

NOT_SUPPORTED: dict[str, str] = {}
"""Families with a declared plan that `tp` refuses, and what in them it does not split yet."""

_WAYS_OUT = (
    "use parallel.decode gather (each rank keeps the whole model after the first forward) or reshard "
    "(gathers each layer for every token; least memory)"
)


def tp_unavailable(hf_config, parts: int) -> str | None:
    """Why `tp` cannot run this model over `parts` ranks (a message naming what to do), or None when it can."""
    config = hf_config.get_text_config()
    model_type = getattr(config, "model_type", None)
    if not has_declared_plan(config):
        return (
            f"parallel.decode tp needs the tensor-parallel plan transformers declares for a model family "
            f"(base_model_tp_plan), and {model_type!r} has none: {_WAYS_OUT}"
        )
    if model_type in NOT_SUPPORTED:
        return f"parallel.decode tp does not split {model_type!r} models ({NOT_SUPPORTED[model_type]}): {_WAYS_OUT}"
    if model_type not in SUPPORTED_MODEL_TYPES:
        return (
            f"parallel.decode tp does not support {model_type!r} models yet (it supports "
            f"{', '.join(SUPPORTED_MODEL_TYPES)}): {_WAYS_OUT}"
        )
    if unknown := unknown_words(config):
        return f"{model_type!r}'s parallel plan uses {', '.join(unknown)}, which tp does not know: {_WAYS_OUT}"
    heads = config.num_attention_heads
    if getattr(config, "kv_lora_rank", None) and config.num_key_value_heads != heads:
        return (
            f"this {model_type} config has {config.num_key_value_heads} key/value heads for {heads} query heads, but "
            f"its latent attention (MLA) gives every query head its own key: tp needs num_key_value_heads = "
            f"num_attention_heads; {_WAYS_OUT}"
        )
    if heads < parts:
        return (
            f"the model has {heads} attention heads, fewer than the {parts} ranks of the tensor-parallel "
            f"group: use parallel.decode gather or reshard, or a parallel.fsdp_size of at most {heads}"
        )
    return None


def shard_tp(model: nn.Module, mesh: DeviceMesh, experts: ExpertLayout | None, expert_group) -> dict[str, TPShard]:
    """Lay `model` (still on meta) out for `tp` over the mesh's shard axis; every sliced parameter's `TPShard`."""
    group, rank = mesh.get_group("shard"), mesh.get_local_rank("shard")
    plan = plan_tp(model, dist.get_world_size(group), experts)
    _apply_tp(model, group, rank, experts, expert_group)
    return plan


def attention_splits(model: nn.Module, parts: int) -> list[AttentionSplit | None]:
    """Every decoder layer's head split (pure arithmetic, the same on every rank).

    None for a layer whose attention stays whole: no `self_attn` (linear attention), or a plan that splits none of it.
    """
    config = model.config.get_text_config()
    plan = module_plan(model).items()
    split = {name.split(".self_attn.")[0] for name, kind in plan if ".self_attn." in name and kind in (COLUMN, ROW)}
    return [
        AttentionSplit.of(layer.self_attn, config, parts) if f"model.layers.{index}" in split else None
        for index, layer in enumerate(model.model.layers)
    ]


def plan_tp(model: nn.Module, parts: int, experts: ExpertLayout | None = None) -> dict[str, TPShard]:
    """The `TPShard` of every sliced parameter of `model`, by parameter name."""
    modules = module_plan(model)
    plan = _vocab_plan(model, parts, modules)
    for index, (layer, heads) in enumerate(zip(model.model.layers, attention_splits(model, parts))):
        prefix = f"model.layers.{index}."
        mine = {name: kind for name, kind in modules.items() if name.startswith(prefix)}
        plan.update(_layer_plan(model, layer, prefix, mine, heads, experts, parts))
    return plan


def _layer_plan(model, layer, prefix: str, modules: dict[str, str], heads, experts, parts: int) -> dict:
    """One decoder layer: attention by heads first, then its MLPs by rows evened out against it, then its experts."""
    plan = {}
    attention = {n: k for n, k in modules.items() if n.startswith(prefix + "self_attn.") and k in (COLUMN, ROW)}
    for name, kind in attention.items():
        plan.update(_linear_plan(name, model.get_submodule(name), kind, heads.pieces))
    sinks = getattr(getattr(layer, "self_attn", None), "sinks", None)
    if heads is not None and sinks is not None:
        plan[prefix + "self_attn.sinks"] = TPShard.along(sinks.shape, 0, heads.per_head())
    units = _local_weights(plan, parts)
    for name, kind in modules.items():
        if kind == EXPERTS:
            module = model.get_submodule(name)
            plan_of = biased_experts_plan if has_expert_biases(module) else experts_plan
            plan.update(plan_of(name, module, experts))
        elif kind in (COLUMN, ROW) and name not in attention:
            rows = _mlp_rows(model, name, layer, units)
            plan.update(_linear_plan(name, model.get_submodule(name), kind, lambda m, d, n, rows=rows: rows))
    return plan


def _vocab_plan(model: nn.Module, parts: int, modules: dict[str, str]) -> dict[str, TPShard]:
    """The embedding and the output layer, split by vocabulary ranges (tied ones are one tensor)."""
    embedding = model.get_input_embeddings()
    names = {id(m): n for n, m in model.named_modules()}
    if modules.get(names[id(embedding)]) != VOCAB:
        return {}
    shape = embedding.weight.shape
    vocab = TPShard.along(shape, 0, [(r,) for r in balanced_ranges(shape[0], parts)])
    plan = {f"{names[id(embedding)]}.weight": vocab}
    output = model.get_output_embeddings()
    if output is not None:
        plan[f"{names[id(output)]}.weight"] = vocab
    return plan


def _linear_plan(name: str, module: nn.Module, kind: str, pieces_of) -> dict[str, TPShard]:
    """A column-parallel module's weight (and bias) by output rows, a row-parallel one's weight by input columns."""
    if not isinstance(module, nn.Linear):
        raise ValueError(f"the parallel plan splits {name}, a {type(module).__name__}: tp splits linear layers only")
    dim = 0 if kind == COLUMN else 1
    pieces = pieces_of(module, dim, name)
    plan = {f"{name}.weight": TPShard.along(module.weight.shape, dim, pieces)}
    if module.bias is not None and dim == 0:  # a row-parallel bias is added once, after the sum
        plan[f"{name}.bias"] = TPShard.along(module.bias.shape, 0, pieces)
    return plan


def _local_weights(plan: dict[str, TPShard], parts: int) -> list[int]:
    """Per rank, the elements of the split weights in `plan` it keeps (to even out the MLP rows against)."""
    shards = [shard for name, shard in plan.items() if name.endswith(".weight")]
    return [sum(_numel(shard.local_shape(rank)) for shard in shards) for rank in range(parts)]


def _mlp_rows(model: nn.Module, name: str, layer: nn.Module, attention_units: list[int]) -> list[tuple[range]]:
    """The intermediate rows of the MLP `name` belongs to, per rank.

    The layer's own dense MLP takes rows that even out attention plus MLP weights per rank (a rank
    with more heads gets fewer rows); any other MLP (a shared expert) is split evenly.
    """
    parent_name = name.rpartition(".")[0]
    parent = model.get_submodule(parent_name)
    rows = parent.gate_proj.out_features
    if parent is layer.mlp:
        hidden = parent.gate_proj.in_features
        return [(r,) for r in split_mlp_rows(rows, attention_units, hidden)]
    return [(r,) for r in balanced_ranges(rows, len(attention_units))]


def _numel(shape: tuple[int, ...]) -> int:
    total = 1
    for size in shape:
        total *= size
    return total


def _apply_tp(model: nn.Module, group: dist.ProcessGroup, rank: int, experts, expert_group) -> None:
    """Give the sliced layers their forwards and attention its local head counts (before the weights are read)."""
    parts = dist.get_world_size(group)
    modules = module_plan(model)
    names = {id(m): n for n, m in model.named_modules()}
    embedding = model.get_input_embeddings()
    if modules.get(names[id(embedding)]) == VOCAB:
        vocab = balanced_ranges(embedding.weight.shape[0], parts)
        become(embedding, VocabParallelEmbedding, group, vocab_start=vocab[rank].start)
        if model.get_output_embeddings() is not None:
            become(model.get_output_embeddings(), VocabGatheredLinear, group, vocab_sizes=[len(r) for r in vocab])
    for layer, heads in zip(model.model.layers, attention_splits(model, parts)):
        for attn in attention_modules(layer.self_attn) if heads is not None else []:
            attn.num_key_value_groups = heads.local_groups(rank)
            for norm in (getattr(attn, n, None) for n in ("q_norm", "k_norm")):
                if norm is not None and next(norm.parameters(), None) is not None:  # per-head norms on split heads
                    become_split_input(norm, group)
    for name, kind in modules.items():
        module = model.get_submodule(name)
        if kind == ROW:
            become(module, RowParallelLinear, group)
        elif kind == COLUMN and type(module) is nn.Linear:  # its input gradient is summed over the group
            become(module, ColumnParallelLinear, group)
        elif kind == EXPERTS:
            apply = apply_biased_experts if has_expert_biases(module) else apply_experts
            apply(module, experts, rank, expert_group)
    for name, kind in modules.items():  # the parts are in place: blocks with shared experts sum once
        if kind == EXPERTS:
            maybe_fold_shared_experts(model.get_submodule(name.rpartition(".")[0]), group)
