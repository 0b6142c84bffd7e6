"""`tp` reads the plans transformers declares: which modules split, which stay whole, and the families table."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardbook.rankd.parallel.declared_plans import COLUMN, EXPERTS, ROW, VOCAB, module_plan, unknown_words
from shardbook.rankd.parallel.families import MARK_END, MARK_START, families_table
from shardbook.rankd.parallel.tensor_parallel import SUPPORTED_MODEL_TYPES, plan_tp, tp_unavailable

README = Path(__file__).resolve().parents[2] / "README.md"


def meta_model(model_type: str, **kwargs):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.tiny import MLA_FAMILIES

    settings = {k: v for k, v in MLA_FAMILIES.get(model_type, {}).items() if k not in ("num_heads", "num_kv_heads")}
    config = AutoConfig.for_model(
        model_type, vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=3, **settings, **kwargs
    )
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("model_type", SUPPORTED_MODEL_TYPES)
def test_every_supported_family_uses_only_known_plan_words(model_type):
    from transformers import AutoConfig

    assert unknown_words(AutoConfig.for_model(model_type)) == []


def test_glm5_splits_mla_by_heads_and_keeps_the_latents_and_the_indexer_whole():
    model = meta_model("glm_moe_dsa", num_attention_heads=5, num_key_value_heads=5)
    kinds = module_plan(model)
    attn = "model.layers.1.self_attn"
    assert kinds[f"{attn}.q_b_proj"] == kinds[f"{attn}.kv_b_proj"] == COLUMN and kinds[f"{attn}.o_proj"] == ROW
    assert kinds["model.layers.1.mlp.experts"] == EXPERTS and kinds["model.embed_tokens"] == VOCAB
    assert kinds["model.layers.0.mlp.down_proj"] == ROW  # the dense first layer
    plan = plan_tp(model, 2, _layout())
    for whole in ("q_a_proj", "kv_a_proj_with_mqa", "indexer.wq_b", "indexer.wk", "indexer.weights_proj"):
        assert f"{attn}.{whole}.weight" not in plan, whole
    assert "model.layers.1.mlp.gate.weight" not in plan  # the router: every rank routes every token alike
    kv_b = plan[f"{attn}.kv_b_proj.weight"]  # 5 heads of (8 + 16) rows: 3 and 2 per rank
    assert kv_b.pieces == ((range(72),), (range(72, 120),))
    assert plan[f"{attn}.o_proj.weight"].pieces == ((range(48),), (range(48, 80),))


def _layout():
    from shardbook.rankd.parallel.expert_parallel import ExpertLayout

    return ExpertLayout.of(2, 1, 1)


def test_a_family_without_a_plan_names_gather_and_reshard():
    from transformers import AutoConfig

    message = tp_unavailable(AutoConfig.for_model("gpt2"), 2)
    assert "declares for a model family (base_model_tp_plan), and 'gpt2' has none" in message
    assert "gather" in message and "reshard" in message


def test_the_families_table_lists_every_family_and_its_layouts():
    table = families_table()
    assert "| `glm_moe_dsa` | gather, reshard, tp | ep_size, ep_fsdp_size | fp8 blocks (GLM-5-FP8) |" in table
    assert "| `llama` | gather, reshard, tp | - | - |" in table


def test_readme_families_table_is_generated_from_the_code():
    text = README.read_text()
    assert MARK_START in text and MARK_END in text, "paste families_table() into README.md between the markers"
    start, end = text.index(MARK_START), text.index(MARK_END) + len(MARK_END)
    assert text[start:end] == families_table()


def test_deepseek_v4_keeps_attention_and_hyper_connections_whole_and_splits_its_experts():
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardbook.rankd.parallel.tensor_parallel import attention_splits

    config = AutoConfig.for_model("deepseek_v4", num_hidden_layers=2, hidden_size=64, num_attention_heads=4)
    assert tp_unavailable(config, 2) is None
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    plan = module_plan(model)
    assert not [name for name in plan if ".self_attn." in name or "hc" in name]
    assert attention_splits(model, 2) == [None, None]
    assert plan["model.layers.0.mlp.experts"] == EXPERTS
    assert [plan[f"model.layers.0.mlp.shared_experts.{p}"] for p in ("gate_proj", "up_proj", "down_proj")] == [
        COLUMN,
        COLUMN,
        ROW,
    ]


def test_qwen3_next_keeps_its_linear_attention_whole_and_minimax_m2_its_attention():
    from shardbook.rankd.parallel.tensor_parallel import attention_splits

    qwen = meta_model("qwen3_next", head_dim=16, layer_types=["linear_attention", "full_attention", "linear_attention"])
    assert [split is not None for split in attention_splits(qwen, 2)] == [False, True, False]
    assert not any(".linear_attn." in name for name in plan_tp(qwen, 2, _layout()))
    minimax = meta_model("minimax_m2", head_dim=16)
    assert not any(".self_attn." in name for name in plan_tp(minimax, 2, _layout()))
