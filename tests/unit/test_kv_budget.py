"""The batch's KV cache budget as a load computes it: bytes per token from the attention modules (checked against
what a real transformers cache holds), and the smallest rank's share of free memory over them."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import MLA_FAMILIES, cache_bytes_per_token, make_tiny_lm, make_tiny_mla

from shardbook.rankd.loading.summary import kv_cache_figures


def _model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3"])
def test_bytes_per_token_are_what_a_real_cache_holds(tmp_path: Path, family: str) -> None:
    """Grouped-query heads (llama, qwen3's explicit head_dim) and MLA, whose forward caches every head's keys
    and values whole outside `tp`."""
    if family in MLA_FAMILIES:
        path = make_tiny_mla(tmp_path / family, family)
    else:
        path = make_tiny_lm(tmp_path / family, family=family, num_heads=4, num_kv_heads=2, head_dim=24)
    model = _model(path)
    figures = kv_cache_figures(model, [2**30, 2**30], None)
    assert figures["kv_cache_bytes_per_token"] == [cache_bytes_per_token(model)]


def test_the_budget_is_the_smallest_ranks_share_of_free_memory(tmp_path: Path) -> None:
    model = _model(make_tiny_lm(tmp_path / "m", family="llama"))
    per_token = kv_cache_figures(model, [0], None)["kv_cache_bytes_per_token"][0]
    figures = kv_cache_figures(model, [1000 * per_token, 300 * per_token], None)
    assert figures["kv_cache_tokens"] == 150  # half of rank 1's
    assert figures["kv_cache_tokens_reason"].startswith("50% of rank 1's free memory after the load")
