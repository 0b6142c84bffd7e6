"""The parallel plans transformers declares for a model class, read as the list of modules `tp` slices.

A transformers config declares `base_model_tp_plan` (module pattern -> plan word, e.g.
`"layers.*.self_attn.q_proj": "colwise"`) and `base_model_ep_plan` (the experts that go
expert-parallel); the causal-LM class adds its own `_tp_plan` (`lm_head`). `tp` takes *which*
modules are split, and along which side, from these plans; shardbook's machinery decides *how*
(uneven head splits, each rank reading only its slices, modules changed in place).

What each word means here (transformers' `integrations/tensor_parallel.py` names them):

- `colwise`, `packed_colwise`, `colwise_gather_output`: the module keeps a range of output rows
  (heads for attention, rows for an MLP; the logits of `lm_head` are gathered whole).
- `rowwise`, `rowwise_split_input`: the module keeps the matching input columns; its partial
  outputs are summed over the ranks (one all-reduce).
- `embedding_rowwise`: the embedding keeps a range of the vocabulary.
- `moe_tp_experts`, `ep_dispatch_experts` (with `grouped_gemm` on the fused expert weights): the
  experts module goes expert-parallel (`expert_parallel`), laid out by ep_size / ep_fsdp_size.
- `mla_kv_a_proj`, `replicated_with_grad_allreduce`: the module stays whole on every rank.
- `moe_identity_expert` (LongCat-Flash's zero-compute experts): an identity, nothing to split; the
  experts' forward adds its share once per expert set (`expert_parallel`).

Where a plan leaves something out that splits exactly, `SUPPLEMENTS` adds it; where a plan's word
would compute something else than one process does here, `OVERRIDES` replaces it; each entry says why.
"""

from __future__ import annotations

import re

from torch import nn

COLUMN, ROW, VOCAB, EXPERTS, WHOLE = "column", "row", "vocab", "experts", "whole"

WORDS = {
    "colwise": COLUMN,
    "packed_colwise": COLUMN,
    "colwise_gather_output": COLUMN,
    "rowwise": ROW,
    "rowwise_split_input": ROW,
    "embedding_rowwise": VOCAB,
    "moe_tp_experts": EXPERTS,
    "ep_dispatch_experts": EXPERTS,
    "grouped_gemm": EXPERTS,
    "mla_kv_a_proj": WHOLE,
    "replicated_with_grad_allreduce": WHOLE,
    "replicated": WHOLE,
    "moe_identity_expert": WHOLE,
}
"""Every plan word `tp` understands, and what it makes of it."""

_MLA_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.q_b_proj": "colwise",
    "layers.*.self_attn.kv_b_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}

_GQA_ATTENTION = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
}

SUPPLEMENTS: dict[str, dict[str, tuple[str, str]]] = {
    "*": {
        "embed_tokens": (
            "embedding_rowwise",
            (
                "most plans leave the embedding whole; a vocabulary range per rank saves (N-1)/N of vocab x hidden "
                "for one all-reduce of the hidden state per forward"
            ),
        ),
    },
    "qwen2_moe": {
        f"layers.*.mlp.shared_expert.{proj}": (
            word,
            "Qwen2-MoE's plan leaves the shared expert whole; it is a plain MLP, split like any other",
        )
        for proj, word in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
    },
    "deepseek_v3": {
        pattern: (word, "DeepSeek-V3's plan splits only the MLPs; its MLA splits by heads as DeepSeek-V3.2's plan says")
        for pattern, word in _MLA_ATTENTION.items()
    },
    "gpt_oss": {
        pattern: (word, "GPT-OSS's plan names only the embedding; its attention splits by heads, sinks with them")
        for pattern, word in _GQA_ATTENTION.items()
    },
    "deepseek_v4": {
        f"layers.*.mlp.shared_experts.{proj}": (
            word,
            (
                "DeepSeek-V4's plan splits only the routed experts; its shared expert is a plain MLP (clamped "
                "elementwise), split like any other. Its attention (compressor, indexer, grouped output LoRA) and "
                "the hyper-connections stay whole on every rank: no plan names them"
            ),
        )
        for proj, word in (("gate_proj", "colwise"), ("up_proj", "colwise"), ("down_proj", "rowwise"))
    },
}
"""Per model type (`*`: every one), module pattern -> (plan word, why the declared plan needs it)."""

_LINEAR_ATTENTION = ("in_proj_qkvz", "in_proj_ba", "out_proj")

OVERRIDES: dict[str, dict[str, tuple[str, str]]] = {
    "qwen3_next": {
        f"layers.*.linear_attn.{proj}": (
            "replicated",
            (
                "the plan computes the Gated DeltaNet projections whole on every rank (colwise_gather_output); "
                "its causal conv1d and recurrent state span all heads, so the linear-attention layers stay whole"
            ),
        )
        for proj in _LINEAR_ATTENTION
    },
    "minimax_m2": {
        f"layers.*.self_attn.{proj}": (
            "replicated",
            (
                "MiniMax-M2's q_norm and k_norm take one RMS over all heads together, so a rank's heads alone "
                "cannot be normalised: its attention stays whole on every rank (the plan gathers it too)"
            ),
        )
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj")
    },
}
"""Per model type, module pattern -> (plan word that replaces the declared one, why)."""


def declared_words(config, model: nn.Module | None = None) -> dict[str, str]:
    """Pattern (relative to the root) -> plan word: the config's plans, the LM class's, and shardbook's supplements."""
    text = config.get_text_config()
    prefix = "model."
    words = {prefix + p: w for p, w in (getattr(text, "base_model_tp_plan", None) or {}).items()}
    words.update({prefix + p: w for p, w in (getattr(text, "base_model_ep_plan", None) or {}).items()})
    if model is not None:
        words.update(getattr(type(model), "_tp_plan", None) or {})
    for family in ("*", getattr(text, "model_type", None)):
        for pattern, (word, _why) in SUPPLEMENTS.get(family, {}).items():
            words.setdefault(prefix + pattern, word)
    for pattern, (word, _why) in OVERRIDES.get(getattr(text, "model_type", None), {}).items():
        words[prefix + pattern] = word
    return words


def has_declared_plan(config) -> bool:
    """Whether transformers declares a tensor- or expert-parallel plan for this model's family."""
    text = config.get_text_config()
    return bool(getattr(text, "base_model_tp_plan", None) or getattr(text, "base_model_ep_plan", None))


def unknown_words(config) -> list[str]:
    """Plan words of this family that `tp` does not understand (it refuses the model rather than guess)."""
    return sorted({w for w in declared_words(config).values() if w not in WORDS})


def module_plan(model: nn.Module) -> dict[str, str]:
    """Every module of `model` a plan names, with what `tp` does to it (COLUMN, ROW, VOCAB, EXPERTS or WHOLE).

    Entries naming a parameter (the fused expert weights) belong to their module's `EXPERTS` entry.
    """
    patterns = [(_regex(p), WORDS.get(w, w)) for p, w in declared_words(model.config, model).items()]
    plan = {}
    for name, _module in model.named_modules():
        kinds = [kind for regex, kind in patterns if regex.fullmatch(name)]
        if kinds:
            plan[name] = EXPERTS if EXPERTS in kinds else kinds[0]
    return plan


def _regex(pattern: str) -> re.Pattern:
    """A plan pattern as a regular expression: `*` stands for one index (a layer's or a list's)."""
    return re.compile(re.escape(pattern).replace(r"\*", r"\d+"))
