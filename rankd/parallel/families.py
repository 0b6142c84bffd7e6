"""The supported-families table of the README, rendered from what the code supports (a test keeps them equal).

Layouts: `gather` and `reshard` (FSDP2) load any causal LM whose checkpoint sharded loading can
read; `tp` is listed where `tp_unavailable` accepts the family's default config. Expert
parallelism is listed for families with experts that `tp` runs. Notes come from the default
config (MLA, indexer, shared experts, dense first layers) and from what is not done yet.
"""

from __future__ import annotations

from shardbook.rankd.parallel.expert_parallel import num_experts
from shardbook.rankd.parallel.tensor_parallel import NOT_SUPPORTED, SUPPORTED_MODEL_TYPES, tp_unavailable

LISTED = (*SUPPORTED_MODEL_TYPES, *NOT_SUPPORTED)
"""Every family the table lists: the ones `tp` runs, then the rest of MindSpeed-LLM's FSDP2 examples."""

HOW = {
    "gpt_oss": "attention split by heads, sinks with their heads; expert biases split with the experts",
    "qwen3_next": (
        "gated full attention split by heads; Gated DeltaNet (linear-attention) layers replicated on every rank"
    ),
    "minimax_m2": "attention replicated on every rank (its q/k norms span all heads); experts split",
    "deepseek_v4": (
        "attention (compressor, indexer, grouped output LoRA) and hyper-connections replicated on every rank; "
        "routed experts split, shared experts by rows"
    ),
    "longcat_flash": "both MLAs of a layer split by heads, both MLPs by rows; zero-compute experts added once per set",
}
"""How `tp` handles what is particular to a family, said where the code cannot tell."""

OFFICIAL_FORMATS = {
    "qwen3": "fp8 blocks (Qwen3-*-FP8)",
    "qwen3_moe": "fp8 blocks (Qwen3-*-FP8)",
    "qwen3_next": "fp8 blocks (Qwen3-Next-*-FP8)",
    "glm_moe_dsa": "fp8 blocks (GLM-5-FP8)",
    "deepseek_v3": (
        "fp8 blocks (DeepSeek-V3, R1, Kimi-K2), ue8m0 scales (V3.1); compressed-tensors int4 experts (Kimi-K2-Thinking)"
    ),
    "deepseek_v32": "fp8 blocks with ue8m0 scales (V3.2)",
    "gpt_oss": "mxfp4 experts",
    "minimax_m2": "fp8 blocks, router and lm_head unquantized",
    "deepseek_v4": "fp4 (e2m1) experts over fp8-block linears",
}
"""The quantized formats each family's official weights ship in (every family also reads float checkpoints,
fine-grained FP8 and compressed-tensors; see docs/quantized.md)."""

MARK_START, MARK_END = "<!-- families:start -->", "<!-- families:end -->"


def family_row(model_type: str) -> list[str]:
    """One row: family, layouts, expert parallelism, official quantized formats, notes."""
    from transformers import AutoConfig

    config = AutoConfig.for_model(model_type).get_text_config()
    tp = tp_unavailable(config, 2) is None
    layouts = ", ".join(["gather", "reshard", *(["tp"] if tp else [])])
    experts = num_experts(config)
    expert_parallel = "ep_size, ep_fsdp_size" if tp and experts else "-"
    formats = OFFICIAL_FORMATS.get(model_type, "-")
    return [f"`{model_type}`", layouts, expert_parallel, formats, "; ".join(_notes(config, model_type))]


def _notes(config, model_type: str) -> list[str]:
    notes = []
    if model_type in SUPPORTED_MODEL_TYPES and model_type not in HOW and getattr(config, "kv_lora_rank", None):
        notes.append("MLA split by heads, latent KV cache whole on every rank")
    if model_type in SUPPORTED_MODEL_TYPES and getattr(config, "index_topk", None):
        notes.append("sparse-attention indexer replicated")
    if getattr(config, "n_shared_experts", None) or getattr(config, "shared_expert_intermediate_size", None):
        notes.append("shared experts")
    if getattr(config, "first_k_dense_replace", None):
        notes.append("dense first layers")
    if model_type in HOW:
        notes.append(HOW[model_type])
    if model_type in NOT_SUPPORTED:
        notes.append(f"tp not yet: {NOT_SUPPORTED[model_type]}")
    return notes


def families_table() -> str:
    """The markdown table, markers included, as the README holds it."""
    lines = ["| family | layouts | expert parallel | official quantized weights | notes |", "| --- " * 5 + "|"]
    lines += ["| " + " | ".join(family_row(model_type)) + " |" for model_type in LISTED]
    return "\n".join([MARK_START, *lines, MARK_END])
