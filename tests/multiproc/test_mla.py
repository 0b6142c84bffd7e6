"""Multi-head latent attention under `tp` on 2 gloo ranks: GLM-5 (`glm_moe_dsa`), DeepSeek-V3.2 and DeepSeek-V3.

Each family loads once per layout on one process group (spawning costs more than these loads), and every
rank is compared with one process: logits within |a-b| <= 1e-4 (1 + |b|); for GLM-5 also 32 greedy
tokens, the indexer's top-k picks on every layer, the bytes each rank holds and `kv_b_proj` joined whole.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids
from tests.tiny import MLA_FAMILIES, make_tiny_mla

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
NEW_TOKENS = 32
LAYOUTS = {"tp": {"decode": "tp"}, "tp-ep2": {"decode": "tp", "ep_size": 2}}


def run(model, tokenizer, extras: bool) -> dict:
    """Prompt logits; with `extras`, every indexer's picks on the prompt and 32 greedy tokens."""
    picks: dict[int, torch.Tensor] = {}
    hooks = [
        layer.self_attn.indexer.register_forward_hook(lambda m, a, out, i=i: picks.setdefault(i, out.clone()))
        for i, layer in enumerate(model.model.layers)
        if extras and getattr(layer.self_attn, "indexer", None) is not None
    ]
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model(ids).logits
        for hook in hooks:
            hook.remove()
        tokens = None
        if extras:
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
            tokens = out[0, ids.shape[1] :]
    return {"logits": logits, "picks": picks, "tokens": tokens}


def one_process(path, extras: bool) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    result = run(model, AutoTokenizer.from_pretrained(path), extras)
    result["kv_b_proj"] = model.model.layers[0].self_attn.kv_b_proj.weight.detach().clone()
    return result


def load_and_run(rank: int, path, parallel: dict, extras: bool) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
    )
    loaded = load_sharded(config, device="cpu")
    model = loaded.model
    held = sum(p.numel() * p.element_size() for p in model.parameters())
    result = run(model, loaded.tokenizer, extras)
    whole = full_parameter_on_rank0(model, model.model.layers[0].self_attn.kv_b_proj.weight)
    return {**result, "held": held, "summary": loaded.summary, "kv_b_proj": whole}


def load_each(rank: int, paths: dict, parallel: dict) -> dict:
    return {family: load_and_run(rank, path, parallel, family == "glm_moe_dsa") for family, path in paths.items()}


@pytest.fixture(scope="module")
def mla_families(tmp_path_factory) -> dict:
    """Each family's tiny checkpoint and one process's results."""
    paths = {family: make_tiny_mla(tmp_path_factory.mktemp(family) / "model", family) for family in MLA_FAMILIES}
    return {family: (path, one_process(path, family == "glm_moe_dsa")) for family, path in paths.items()}


def close(got: torch.Tensor, want: torch.Tensor, msg: str) -> None:
    """|a - b| <= 1e-4 * (1 + |b|) everywhere."""
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=msg)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_mla_families_match_one_process_under_tp(ranks, mla_families, layout):
    parallel = LAYOUTS[layout]
    per_rank = ranks(load_each, {f: path for f, (path, _) in mla_families.items()}, parallel, deadline=300)
    for family, (_, reference) in mla_families.items():
        for rank, results in enumerate(per_rank):
            result = results[family]
            close(result["logits"], reference["logits"], f"{family} rank {rank}")
            summary = result["summary"]
            assert summary["decode"] == "tp", (family, summary["decode_reason"])
            if "ep_size" in parallel:
                assert "mesh (edp=1, efsdp=1, ep=2)" in summary["decode_reason"], family
        torch.testing.assert_close(per_rank[0][family]["kv_b_proj"], reference["kv_b_proj"], atol=0, rtol=0)
    glm = [results["glm_moe_dsa"] for results in per_rank]
    _, reference = mla_families["glm_moe_dsa"]
    full = glm[0]["summary"]["full_param_bytes"]
    for rank, result in enumerate(glm):
        assert result["tokens"].tolist() == reference["tokens"].tolist(), f"rank {rank}"
        assert sorted(result["picks"]) == sorted(reference["picks"]) == [0, 1]  # layer 2 reuses layer 1's picks
        for layer, picks in reference["picks"].items():
            assert torch.equal(result["picks"][layer].sort(-1).values, picks.sort(-1).values), (rank, layer)
        assert result["held"] <= 0.6 * full, (rank, result["held"], full)
        # the latent (16 + 8) on 3 layers and the indexer keys (16) on the 2 indexed ones, float32, on every rank
        assert result["summary"]["kv_cache_bytes_per_token"] == [4 * (3 * 24 + 2 * 16)] * 2
        whole = result["summary"]["replicated_bytes"]
        assert whole["model.layers.*.self_attn.indexer.wq_b.weight"] == 2 * 4 * 32 * 32, whole


def test_deepseek_v4_loads_sharded_with_its_final_norm(ranks, tmp_path):
    """DeepSeek-V4's renames are unscoped (`.norm.` -> `.kv_norm.`): `model.norm.weight` must still load as itself."""
    from tests.multiproc.test_moe import load_and_forward
    from tests.tiny import DEEPSEEK_V4, make_tiny_lm

    path = make_tiny_lm(tmp_path / "v4", family="deepseek_v4", **DEEPSEEK_V4)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(prompt_ids(AutoTokenizer.from_pretrained(path))).logits
    for rank, result in enumerate(ranks(load_and_forward, path, {"decode": "gather"})):
        close(result["logits"], reference, f"rank {rank}")


def test_deepseek_v4_final_norm_is_read_from_its_own_name(tmp_path):
    """The read plan (no ranks) finds `model.norm.weight` under its own name, not renamed to `model.kv_norm.weight`."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardbook.rankd.loading.weight_reading import plan_reads
    from tests.tiny import DEEPSEEK_V4, make_tiny_lm

    path = make_tiny_lm(tmp_path / "v4", family="deepseek_v4", **DEEPSEEK_V4)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    targets = plan_reads(model, path)
    assert "model.norm.weight" in targets and "model.layers.0.self_attn.kv_norm.weight" in targets


def load_shipped_config(rank: int, path) -> dict:
    """configs/glm-744b-npu.yaml as shipped, with only the checkpoint, ranks, device and dtype overridden."""
    from shardbook.rankd.config.parsing import load_config
    from shardbook.rankd.loading.load_sharded import load_sharded

    overrides = [
        *("--model.model_name_or_path", str(path), "--model.dtype", "float32"),
        *("--parallel.fsdp_size", "2", "--parallel.ep_size", "2", "--parallel.ep_fsdp_size", "1"),
        *("--parallel.device", "cpu"),
    ]
    config = load_config(CONFIGS / "glm-744b-npu.yaml", overrides, world_size=2)
    return load_sharded(config, device="cpu").summary


def test_the_shipped_glm5_config_loads_a_tiny_glm5_under_tp(ranks, mla_families):
    from transformers import GlmMoeDsaConfig

    from shardbook.rankd.config.parsing import load_config

    shipped = load_config(CONFIGS / "glm-744b-npu.yaml", world_size=32)
    assert shipped.parallel.decode == "tp" and GlmMoeDsaConfig().n_routed_experts % shipped.parallel.ep_size == 0
    path, _ = mla_families["glm_moe_dsa"]
    for summary in ranks(load_shipped_config, path):
        assert summary["architecture"] == "GlmMoeDsaForCausalLM" and summary["decode"] == "tp"
        assert "mesh (edp=1, efsdp=1, ep=2)" in summary["decode_reason"]
