"""FP8 block weights kept as FP8 (`model.fp8_weights keep-reference`) on 2 gloo ranks, against the exact
dequantization of the same codes (the checkpoints and references of tests/multiproc/test_quantized.py).

The reference path computes here (a CPU has no FP8 matmul): logits within |a - b| <= 1e-4 (1 + |b|) of the
dequantized twin's under `tp` (5 query heads split 3 and 2: row slices start inside the 32 x 32 blocks, o_proj's
column slices too), `tp` with `ep_size 2` (DeepSeek-V3.1) and MiniMax-M2's whole attention under `tp`; the kept
weights are e4m3 codes (counted in bytes), `keep` on a CPU dequantizes with a note, and `gather` with a kept
weight is refused.
"""

from __future__ import annotations

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids
from tests.multiproc.test_mla import close
from tests.multiproc.test_quantized import CHECKPOINTS, make_checkpoint

pytestmark = pytest.mark.timeout(600)

KEPT = ("llama-fp8-blocks", "deepseek-v3.1-fp8-ue8m0", "minimax-m2-fp8")
RUNS = {
    # name: (checkpoint, model.fp8_weights, parallel)
    "llama tp": ("llama-fp8-blocks", "keep-reference", {"decode": "tp"}),
    "llama auto means tp": ("llama-fp8-blocks", "keep-reference", {}),
    "deepseek-v3.1 tp ep2": ("deepseek-v3.1-fp8-ue8m0", "keep-reference", {"decode": "tp", "ep_size": 2}),
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
        }
    return results


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
    assert ", 14 kept in FP8 (below), the rest dequantized to float32;" in quantized_line(llama_summary)
    line = fp8_line(llama_summary)
    assert line.startswith("14 linear layer(s) held as e4m3 codes") and "14 by the reference path" in line, line
    deepseek = per_rank[0]["deepseek-v3.1 tp ep2"]["summary"]["fp8_kept"]
    assert "model.layers.*.self_attn.kv_a_proj_with_mqa" in deepseek, deepseek
