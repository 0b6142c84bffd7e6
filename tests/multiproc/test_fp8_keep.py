"""FP8 block weights kept as FP8 (`model.fp8_weights keep-reference`) on 2 gloo ranks, against the exact
dequantization of the same codes (the checkpoints and references of tests/multiproc/test_quantized.py).

The reference path computes here (a CPU has no FP8 matmul): logits within |a - b| <= 1e-4 (1 + |b|) of the
dequantized twin's under `tp` (5 query heads split 3 and 2: row slices start inside the 32 x 32 blocks, o_proj's
column slices too), DeepSeek-V3.1 under `tp` (each routed expert's 32 rows split 16 and 16: gate's and up's row
slices and down's column slices start inside blocks) and `tp` with `ep_size 2` (4 whole experts a rank), and
MiniMax-M2 (attention whole, experts split by rows) under `tp`. The kept linears and routed experts hold e4m3
codes (counted in bytes: the experts hold nothing but their codes and scales), `full_parameter` of a kept linear
or expert weight is its exact dequantization, `keep` on a CPU dequantizes with a note, and `gather` with a kept
weight is refused. A tiny GLM-5-FP8 under `tp` (experts split by rows) equals its own dequantized load.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids
from tests.multiproc.test_mla import close
from tests.multiproc.test_quantized import CHECKPOINTS, make_checkpoint
from tests.quantized import write_quantized
from tests.tiny import make_tiny_mla

pytestmark = pytest.mark.timeout(600)

KEPT = ("llama-fp8-blocks", "deepseek-v3.1-fp8-ue8m0", "minimax-m2-fp8")
EXPERTS_DOWN = "model.layers.1.mlp.experts.down_proj"
"""DeepSeek-V3's fused routed experts' down_proj: split by experts under ep_size 2, by columns under tp."""
RUNS = {
    # name: (checkpoint, model.fp8_weights, parallel)
    "llama tp": ("llama-fp8-blocks", "keep-reference", {"decode": "tp"}),
    "llama auto means tp": ("llama-fp8-blocks", "keep-reference", {}),
    "deepseek-v3.1 tp ep2": ("deepseek-v3.1-fp8-ue8m0", "keep-reference", {"decode": "tp", "ep_size": 2}),
    "deepseek-v3.1 tp (experts by rows)": ("deepseek-v3.1-fp8-ue8m0", "keep-reference", {"decode": "tp"}),
    "minimax-m2 tp (attention whole)": ("minimax-m2-fp8", "keep-reference", {"decode": "tp"}),
    "llama keep on a cpu": ("llama-fp8-blocks", "keep", {"decode": "tp"}),
    "llama gather refused": ("llama-fp8-blocks", "keep-reference", {"decode": "gather"}),
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    return {name: make_checkpoint(name, tmp_path_factory.mktemp(name)) for name in KEPT}


def load_runs(rank: int, runs: dict) -> dict:
    """Each run's logits, summary and held FP8 bytes on this rank, or its error."""
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.parallel.fp8_linear import FP8Linear
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    results = {}
    for name, (path, weight, fp8_weights, parallel) in runs.items():
        model = ModelConfig(model_name_or_path=str(path), dtype="float32", fp8_weights=fp8_weights)
        try:
            loaded = load_sharded(ShardbookConfig(model=model, parallel=ParallelConfig(**parallel)), device="cpu")
        except ValueError as e:
            results[name] = {"error": str(e)}
            continue
        with torch.no_grad():
            logits = loaded.model(prompt_ids(loaded.tokenizer)).logits
        kept = [m for m in loaded.model.modules() if isinstance(m, FP8Linear)]
        results[name] = {
            "logits": logits,
            "summary": loaded.summary,
            "code_dtypes": {m.weight.dtype for m in kept},
            "code_elements": sum(m.weight.numel() for m in kept),
            "held_bytes": sum(m.weight.nbytes + m.weight_scale_inv.nbytes for m in kept),
            "whole": full_parameter_on_rank0(loaded.model, loaded.model.get_parameter(weight)),
            **expert_figures(loaded.model),
        }
    return results


def expert_figures(model) -> dict:
    """What the routed experts kept in FP8 hold on this rank (every tensor of theirs), and DeepSeek's fused
    down_proj gathered whole on rank 0."""
    from shardbook.rankd.parallel.fp8_experts import FP8Experts
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    experts = [m for m in model.modules() if isinstance(m, FP8Experts)]
    codes = [getattr(m, w) for m in experts for w in m.fp8_layout]
    scales = [getattr(m, w + "_scale_inv") for m in experts for w in m.fp8_layout]
    figures = {
        "expert_code_dtypes": {c.dtype for c in codes},
        "expert_code_elements": sum(c.numel() for c in codes),
        "expert_scale_bytes": sum(s.nbytes for s in scales),
        "expert_held_bytes": sum(
            t.nbytes for m in experts for t in [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        ),
    }
    if EXPERTS_DOWN in dict(model.named_parameters()):
        figures["experts_down"] = full_parameter_on_rank0(model, model.get_parameter(EXPERTS_DOWN))
    return figures


def test_kept_fp8_weights_match_their_dequantization(ranks, checkpoints):
    from shardbook.magics.views.tables import fp8_line, quantized_line

    runs = {name: (checkpoints[c][0], CHECKPOINTS[c][3], fp8, parallel) for name, (c, fp8, parallel) in RUNS.items()}
    per_rank = ranks(load_runs, runs, deadline=500)
    for name, (ckpt, fp8, _) in RUNS.items():
        reference = checkpoints[ckpt][1]
        for rank, results in enumerate(per_rank):
            got = results[name]
            if name == "llama gather refused":
                assert "keeps FP8 weights under parallel.decode tp only" in got["error"], got
                continue
            close(got["logits"], reference, f"{name}, rank {rank}")
            summary = got["summary"]
            if fp8 == "keep":  # a CPU has no FP8 matmul: dequantized, and the summary says why
                assert summary["fp8_kept_modules"] == 0 and "dequantized" in summary["fp8_weights"], summary
                continue
            assert summary["decode"] == "tp", summary["decode_reason"]
            assert got["code_dtypes"] == {torch.float8_e4m3fn}, got["code_dtypes"]
            # one byte a code plus a float32 scale per row per 32 columns: 0.56 of bf16's two bytes (0.52 at 128)
            assert got["held_bytes"] <= 0.6 * 2 * got["code_elements"], got
            assert summary["fp8_kept_modules"] > 0 and summary["fp8_kernel_modules"] == 0, summary
            if CHECKPOINTS[ckpt][2]:  # the routed experts are kept too, holding only their codes and scales
                assert got["expert_code_dtypes"] == {torch.float8_e4m3fn}, got
                assert got["expert_held_bytes"] == got["expert_code_elements"] + got["expert_scale_bytes"], got
                assert got["expert_held_bytes"] <= 0.6 * 2 * got["expert_code_elements"], got
                assert summary["fp8_kept_experts"] > 0 and summary["fp8_kernel_experts"] == 0, summary
        if "whole" in per_rank[0][name]:  # full_parameter dequantizes kept codes: q_proj split, kv_a_proj whole
            torch.testing.assert_close(per_rank[0][name]["whole"], checkpoints[ckpt][2], atol=0, rtol=0, msg=name)
    llama_summary = per_rank[0]["llama tp"]["summary"]
    llama = llama_summary["fp8_kept"]
    # every FP8 linear of both layers is kept (lm_head and embeddings are not FP8 in the checkpoint)
    assert set(llama) == {
        f"model.layers.*.{m}"
        for m in (
            "self_attn.q_proj",
            "self_attn.k_proj",
            "self_attn.v_proj",
            "self_attn.o_proj",
            "mlp.gate_proj",
            "mlp.up_proj",
            "mlp.down_proj",
        )
    }, llama
    assert ", 14 linear layer(s) kept in FP8 (below), the rest dequantized to float32;" in quantized_line(llama_summary)
    line = fp8_line(llama_summary)
    assert line.startswith("14 linear layer(s) held as e4m3 codes") and "14 by the reference path" in line, line
    deepseek_summary = per_rank[0]["deepseek-v3.1 tp ep2"]["summary"]
    deepseek = deepseek_summary["fp8_kept"]
    assert "model.layers.*.self_attn.kv_a_proj_with_mqa" in deepseek, deepseek
    # the one MoE layer's fused experts (the first layer is dense)
    assert deepseek["model.layers.*.mlp.experts.gate_up_proj"] == deepseek["model.layers.*.mlp.experts.down_proj"] == 1
    line = fp8_line(deepseek_summary)
    assert " and 2 fused expert tensor(s) (the routed experts' gate_up_proj and down_proj) held as e4m3" in line, line
    # full_parameter of the kept experts: each rank's 4 experts under ep_size 2, their columns 16 and 16 under tp
    down = reference_experts_down(checkpoints["deepseek-v3.1-fp8-ue8m0"][0])
    for name in ("deepseek-v3.1 tp ep2", "deepseek-v3.1 tp (experts by rows)"):
        torch.testing.assert_close(per_rank[0][name]["experts_down"], down, atol=0, rtol=0, msg=name)


def reference_experts_down(quantized) -> torch.Tensor:
    """DeepSeek's fused down_proj of layer 1 from the dequantized twin's per-expert tensors."""
    from safetensors.torch import load_file

    state = load_file(quantized.with_name(quantized.name + "-reference") / "model.safetensors")
    return torch.stack([state[f"model.layers.1.mlp.experts.{e}.down_proj.weight"] for e in range(8)])


def test_glm5_kept_experts_match_its_dequantized_load(ranks, tmp_path):
    """GLM-5 (the FP8 flagship's shapes: MLA, the indexer, grouped routing, a shared expert) under `tp` without
    expert parallelism: every routed expert's rows split 16 and 16, kept in FP8, against the same checkpoint
    dequantized (whose logits tests/multiproc/test_quantized.py checks against transformers)."""
    path, _ = write_quantized(make_tiny_mla(tmp_path / "float32", "glm_moe_dsa"), tmp_path / "glm5", "fp8-blocks")
    weight = "model.layers.2.mlp.experts.gate_up_proj"
    runs = {mode: (path, weight, mode, {"decode": "tp"}) for mode in ("dequantize", "keep-reference")}
    for rank, results in enumerate(ranks(load_runs, runs, deadline=300)):
        dequantized, kept = results["dequantize"], results["keep-reference"]
        close(kept["logits"], dequantized["logits"], f"rank {rank}")
        # the two MoE layers' gate_up_proj and down_proj, holding their codes and scales only
        assert kept["summary"]["fp8_kept_experts"] == 4 and kept["expert_code_dtypes"] == {torch.float8_e4m3fn}
        assert kept["expert_held_bytes"] == kept["expert_code_elements"] + kept["expert_scale_bytes"], kept
        assert dequantized["summary"].get("fp8_kept_experts", 0) == 0
        if rank == 0:  # full_parameter of the kept experts is the dequantized load's weight, exactly
            torch.testing.assert_close(kept["whole"], dequantized["whole"], atol=0, rtol=0)
