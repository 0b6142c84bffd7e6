"""The batch's cache layers grow in place (`growing_layers`): a decode step writes into room after the cached
positions instead of copying the layer, the model's outputs are those of transformers' concatenating layers, and a
tensor the batch's row operations put in place is never written through."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache, GlmMoeDsaConfig

from shardbook.rankd.generation.cache_keyword import cache_keyword
from shardbook.rankd.generation.cache_rows import append_rows, layer_refusal, select_rows
from shardbook.rankd.generation.growing_layers import MIN_ROOM, grow_in_place, layer_kind
from tests.tiny import make_tiny_llama, make_tiny_mla


@pytest.fixture(scope="module", params=["llama", "glm_moe_dsa"])
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "llama":
        make_tiny_llama(path)
    else:  # 8 indexer heads: scores that tie exactly would let topk order them by the forward's shape
        make_tiny_mla(path, "glm_moe_dsa", index_n_heads=8)
    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()


def _decode(model, cache: DynamicCache, steps: int, grow: bool) -> tuple[list[torch.Tensor], list[int]]:
    """A 2-row prefill, then `steps` greedy decode steps (growing in place after the prefill, as the batch's cache
    does, when `grow`): each step's logits, and the first layer's keys' address after each step."""
    ids = torch.randint(10, 200, (2, 20), generator=torch.Generator().manual_seed(0))
    logits, addresses = [], []
    with torch.no_grad():
        out = model(ids, **{cache_keyword(model): cache}, use_cache=True)
        if grow:
            grow_in_place(cache)
        for _ in range(steps):
            out = model(out.logits[:, -1:].argmax(-1), **{cache_keyword(model): cache}, use_cache=True)
            logits.append(out.logits[:, -1])
            addresses.append(cache.layers[0].keys.data_ptr())
    return logits, addresses


def test_decode_steps_write_in_place_and_give_transformers_outputs(model) -> None:
    plain, growing = DynamicCache(config=model.config), DynamicCache(config=model.config)
    expected, _ = _decode(model, plain, 100, grow=False)
    got, addresses = _decode(model, growing, 100, grow=True)
    assert all((a - b).abs().max() <= 1e-5 for a, b in zip(got, expected))
    assert layer_kind(growing.layers[0]) == type(plain.layers[0]).__name__ and layer_refusal(growing) is None
    assert 1 < len(set(addresses)) <= 4  # room of 64 past 20, then a larger buffer now and then: not one per step
    if hasattr(growing.layers[0], "indexer_keys"):  # GLM-5's indexer keys grow in place too
        indexer = growing.layers[0].indexer_keys
        assert indexer.shape[1] == 120 and indexer.stride(1) == indexer.shape[2] and not indexer.is_contiguous()


def test_a_tensor_the_row_operations_put_in_place_is_copied_before_it_grows() -> None:
    cache = DynamicCache(config=GlmMoeDsaConfig(num_hidden_layers=1, index_topk_pattern="F"))
    grow_in_place(cache)
    layer = cache.layers[0]
    rows = torch.arange(2 * 3, dtype=torch.float32).view(2, 1, 3, 1)
    layer.update(rows, rows)
    layer.update_indexer(rows.view(2, 3, 1))
    before = layer.keys
    assert before.shape == (2, 1, 3, 1) and layer.__dict__["_room_keys"].shape[2] == 3 + MIN_ROOM
    joining = DynamicCache(config=GlmMoeDsaConfig(num_hidden_layers=1, index_topk_pattern="F"))
    joining.layers[0].update(rows[:1] + 100, rows[:1] + 100)
    joining.layers[0].update_indexer(rows[:1].view(1, 3, 1) + 100)
    append_rows(cache, joining, 3)  # a join: the batch's tensors are new ones
    select_rows(cache, torch.tensor([0, 2]), 3)  # a leave: new ones again
    kept = layer.keys
    step = torch.full((2, 1, 1, 1), -1.0)
    layer.update(step, step)
    layer.update_indexer(step.view(2, 1, 1))
    assert layer.keys[:, 0, :, 0].tolist() == [[0, 1, 2, -1], [100, 101, 102, -1]]
    assert layer.indexer_keys[:, :, 0].tolist() == [[0, 1, 2, -1], [100, 101, 102, -1]]
    assert kept.data_ptr() != layer.keys.data_ptr()  # copied into a buffer of its own, not written through
    assert before[:, 0, :, 0].tolist() == [[0, 1, 2], [3, 4, 5]]  # the old buffer's view is untouched
