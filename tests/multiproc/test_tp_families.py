"""`tp` on 2 gloo ranks for GPT-OSS, Qwen3-Next, MiniMax-M2, LongCat-Flash and DeepSeek-V4, each compared with one
process.

Every family loads once per layout on one process group; logits within |a-b| <= 1e-4 (1 + |b|) on every
rank, and 8 greedy tokens equal. 5 query heads on 1 KV head (3 and 2 per rank). GPT-OSS has random expert
biases and sinks (split with the experts and heads); Qwen3-Next a Gated DeltaNet layer (whole on every rank)
then a gated attention layer (split by heads); MiniMax-M2 keeps its attention whole (q/k norms over all heads);
LongCat-Flash has two MLAs per layer (5 heads each, split 3 and 2) and zero-compute experts (2 of 6). DeepSeek-V4
keeps its attention (compressor, indexer, grouped output LoRA) and hyper-connections whole on every rank, which the
load summary counts in its replicated bytes; its routed experts split (4 of 8 per rank under ep_size 2), its shared
expert by rows.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids
from tests.multiproc.test_mla import close
from tests.tiny import TP_FAMILIES, make_tiny_tp_family

NEW_TOKENS = 8
LAYOUTS = {"tp": {"decode": "tp"}, "tp-ep2": {"decode": "tp", "ep_size": 2}}


def run(model, tokenizer) -> dict:
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model(ids).logits
        out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    return {"logits": logits, "tokens": out[0, ids.shape[1] :].tolist()}


def local_shapes(model) -> dict:
    layers = ("model.layers.0.", "model.layers.1.")
    return {name: tuple(p.shape) for name, p in model.named_parameters() if name.startswith(layers)}


def load_each(rank: int, paths: dict, parallel: dict) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    results = {}
    for family, path in paths.items():
        config = ShardbookConfig(
            model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
        )
        loaded = load_sharded(config, device="cpu")
        results[family] = {
            **run(loaded.model, loaded.tokenizer),
            "summary": loaded.summary,
            "shapes": local_shapes(loaded.model),
        }
    return results


@pytest.fixture(scope="module")
def tp_families(tmp_path_factory) -> dict:
    """Each family's tiny checkpoint and one process's results."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    families = {}
    for family in TP_FAMILIES:
        path = make_tiny_tp_family(tmp_path_factory.mktemp(family) / "model", family)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        families[family] = (path, run(model, AutoTokenizer.from_pretrained(path)))
    return families


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_more_families_match_one_process_under_tp(ranks, tp_families, layout):
    parallel = LAYOUTS[layout]
    per_rank = ranks(load_each, {f: path for f, (path, _) in tp_families.items()}, parallel, deadline=240)
    for family, (_, reference) in tp_families.items():
        for rank, results in enumerate(per_rank):
            result = results[family]
            close(result["logits"], reference["logits"], f"{family} rank {rank}")
            assert result["tokens"] == reference["tokens"], (family, rank)
            assert result["summary"]["decode"] == "tp", (family, result["summary"]["decode_reason"])
    gpt_oss = [results["gpt_oss"]["shapes"] for results in per_rank]
    assert [s["model.layers.1.self_attn.sinks"] for s in gpt_oss] == [(3,), (2,)]
    if "ep_size" in parallel:
        assert [s["model.layers.1.mlp.experts.down_proj_bias"] for s in gpt_oss] == [(2, 64), (2, 64)]
    else:
        assert [s["model.layers.1.mlp.experts.gate_up_proj_bias"] for s in gpt_oss] == [(4, 128), (4, 128)]
    qwen = [results["qwen3_next"]["shapes"] for results in per_rank]
    assert [s["model.layers.1.self_attn.q_proj.weight"] for s in qwen] == [(96, 64), (64, 64)]  # query + gate
    minimax = [results["minimax_m2"]["shapes"] for results in per_rank]
    assert [s["model.layers.1.self_attn.q_proj.weight"] for s in minimax] == [(80, 64)] * 2  # whole
    longcat = [results["longcat_flash"]["shapes"] for results in per_rank]
    assert [s["model.layers.0.self_attn.1.kv_b_proj.weight"] for s in longcat] == [(72, 16), (48, 16)]
    v4 = [results["deepseek_v4"] for results in per_rank]
    assert [r["shapes"]["model.layers.1.self_attn.q_b_proj.weight"] for r in v4] == [(64, 32)] * 2  # whole
    assert [r["shapes"]["model.layers.1.mlp.shared_experts.gate_proj.weight"] for r in v4] == [(64, 64)] * 2
    experts = [r["shapes"]["model.layers.1.mlp.experts.gate_up_proj"] for r in v4]
    assert experts == ([(4, 256, 64)] * 2 if "ep_size" in parallel else [(8, 128, 64)] * 2)
    replicated = v4[0]["summary"]["replicated_bytes"]
    assert replicated["model.layers.*.self_attn.q_b_proj.weight"] == 2 * 64 * 32 * 4
    assert any("hc" in name for name in replicated), sorted(replicated)
