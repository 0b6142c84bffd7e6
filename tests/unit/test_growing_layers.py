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
from shardbook.rankd.generation.growing_layers import LEFT_ROOM, MIN_ROOM, grow_in_place, kept_order, layer_kind
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


def _grown_rows(rows: list[list[float]]) -> tuple[DynamicCache, object]:
    """A growing GLM-5 cache layer holding `rows` (one head, one channel) as keys, values and indexer keys."""
    cache = DynamicCache(config=GlmMoeDsaConfig(num_hidden_layers=1, index_topk_pattern="F"))
    grow_in_place(cache)
    layer = cache.layers[0]
    tensor = torch.tensor(rows).view(len(rows), 1, -1, 1)
    layer.update(tensor, tensor)
    layer.update_indexer(tensor.view(len(rows), -1, 1))
    return cache, layer


def _rows(layer) -> list[list[float]]:
    assert layer.indexer_keys[:, :, 0].tolist() == layer.keys[:, 0, :, 0].tolist() == layer.values[:, 0, :, 0].tolist()
    return layer.keys[:, 0, :, 0].tolist()


def _joining(rows: list[list[float]]) -> DynamicCache:
    cache = DynamicCache(config=GlmMoeDsaConfig(num_hidden_layers=1, index_topk_pattern="F"))
    tensor = torch.tensor(rows).view(len(rows), 1, -1, 1)
    cache.layers[0].update(tensor, tensor)
    cache.layers[0].update_indexer(tensor.view(len(rows), -1, 1))
    return cache


def test_kept_order_fills_the_leaving_rows_places_with_the_last_rows() -> None:
    assert kept_order(5, [1, 3]) == [0, 4, 2]
    assert kept_order(5, [4]) == [0, 1, 2, 3]
    assert kept_order(4, [0, 1]) == [2, 3]
    assert kept_order(3, [0, 1, 2]) == []


def test_a_join_writes_its_rows_into_the_room_after_the_batch_and_widens_the_padding() -> None:
    cache, layer = _grown_rows([[1, 2, 3], [4, 5, 6]])
    buffers = {name: layer.__dict__[f"_room_{name}"] for name in ("keys", "values", "indexer_keys")}
    first_row = layer.keys[0, 0, 0].data_ptr()
    append_rows(cache, _joining([[7, 8, 9, 10, 11]]), 5)  # longer than the batch: two more columns of padding
    assert _rows(layer) == [[0, 0, 1, 2, 3], [0, 0, 4, 5, 6], [7, 8, 9, 10, 11]]
    assert all(layer.__dict__[f"_room_{name}"] is buffer for name, buffer in buffers.items())  # no new buffer
    assert layer.keys[0, 0, 2].data_ptr() == first_row  # the held rows did not move
    append_rows(cache, _joining([[12, 13]]), 5)  # shorter: left-padded to the batch
    assert _rows(layer)[3] == [0, 0, 0, 12, 13] and layer.__dict__["_room_keys"] is buffers["keys"]
    step = torch.full((4, 1, 1, 1), -1.0)
    layer.update(step, step)  # a decode step after the joins writes into the same buffer
    layer.update_indexer(step.view(4, 1, 1))
    assert [row[-1] for row in _rows(layer)] == [-1] * 4 and layer.__dict__["_room_keys"] is buffers["keys"]


def test_a_leave_moves_only_the_last_rows_into_the_leaving_rows_places() -> None:
    cache, layer = _grown_rows([[0, 1, 1], [0, 2, 2], [3, 3, 3], [0, 0, 4]])
    buffer, second = layer.__dict__["_room_keys"], layer.keys[1, 0, 1].data_ptr()
    select_rows(cache, kept_order(4, [2]), 2)  # the only row with a token in column 0 leaves: it is cut
    assert _rows(layer) == [[1, 1], [2, 2], [0, 4]]
    assert layer.__dict__["_room_keys"] is buffer and layer.keys[1, 0, 0].data_ptr() == second


def test_a_join_past_the_room_copies_the_batch_once_into_a_larger_buffer() -> None:
    cache, layer = _grown_rows([[1.0] * 3] * 2)
    buffer = layer.__dict__["_room_keys"]
    wide = 3 + LEFT_ROOM + 1
    append_rows(cache, _joining([list(range(wide))]), wide)
    assert layer.__dict__["_room_keys"] is not buffer and buffer.shape[0] >= 2
    assert _rows(layer) == [[0.0] * (wide - 3) + [1.0] * 3] * 2 + [list(map(float, range(wide)))]


def test_a_tensor_put_in_place_of_the_buffer_view_is_copied_before_it_grows() -> None:
    """transformers' own row operations (`crop`, `batch_select_indices`) assign new tensors: the buffer is never
    written where such a tensor reads, nor the tensor itself."""
    cache, layer = _grown_rows([[0, 1, 2], [3, 4, 5]])
    assert layer.__dict__["_room_keys"].shape[2] == LEFT_ROOM + 3 + MIN_ROOM
    replaced = layer.keys.index_select(0, torch.tensor([1, 0]))
    layer.keys, layer.values = replaced, replaced.clone()
    layer.indexer_keys = layer.indexer_keys.index_select(0, torch.tensor([1, 0]))
    append_rows(cache, _joining([[6, 7, 8]]), 3)
    assert _rows(layer) == [[3, 4, 5], [0, 1, 2], [6, 7, 8]]
    step = torch.full((3, 1, 1, 1), -1.0)
    layer.update(step, step)
    layer.update_indexer(step.view(3, 1, 1))
    assert _rows(layer) == [[3, 4, 5, -1], [0, 1, 2, -1], [6, 7, 8, -1]]
    assert replaced[:, 0, :, 0].tolist() == [[3, 4, 5], [0, 1, 2]]
