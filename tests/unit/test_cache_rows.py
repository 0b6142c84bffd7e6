"""The batch cache's row operations (`cache_rows`) on transformers' own cache layers, without a model."""

from __future__ import annotations

import torch
from transformers import DynamicCache, GlmMoeDsaConfig, GptOssConfig, Llama4TextConfig, Qwen3NextConfig
from transformers.cache_utils import DummyLayer

from shardbook.rankd.generation.cache_rows import append_rows, config_refusal, layer_refusal, select_rows


def _indexed_cache(rows: int, columns: int, start: float) -> DynamicCache:
    """A 2-layer GLM-5 cache: layer 0 runs its indexer, layer 1 shares its top-k (no indexer keys)."""
    cache = DynamicCache(config=GlmMoeDsaConfig(num_hidden_layers=2, index_topk_pattern="FS"))
    values = torch.arange(rows * columns, dtype=torch.float32).view(rows, 1, columns, 1) + start
    for i, layer in enumerate(cache.layers):
        layer.update(values.expand(rows, 1, columns, 3), values.expand(rows, 1, columns, 2))
        if i == 0:
            layer.update_indexer(values.view(rows, columns, 1).expand(rows, columns, 4))
    return cache


def test_the_indexer_keys_follow_their_rows() -> None:
    cache, joining = _indexed_cache(2, 3, 0.0), _indexed_cache(1, 5, 100.0)
    append_rows(cache, joining, 5)
    first = cache.layers[0]
    assert first.keys.shape == (3, 1, 5, 3) and first.indexer_keys.shape == (3, 5, 4)
    assert first.indexer_keys[:, :, 0].tolist() == [[0, 0, 0, 1, 2], [0, 0, 3, 4, 5], [100, 101, 102, 103, 104]]
    assert cache.layers[1].indexer_keys is None  # the shared layer keeps none
    select_rows(cache, [1, 2], 4)
    assert first.indexer_keys[:, :, 0].tolist() == [[0, 3, 4, 5], [101, 102, 103, 104]]
    assert torch.equal(first.keys[:, 0, :, 0], first.indexer_keys[:, :, 0])
    assert first.values.shape == (2, 1, 4, 2)


def test_a_sliding_window_keeps_the_batch_s_last_positions() -> None:
    """Rows end at the same column, so the window's last positions are every row's own last ones."""
    caches = [DynamicCache(config=GptOssConfig(num_hidden_layers=2, sliding_window=4)) for _ in range(2)]
    for cache, columns in zip(caches, (2, 6)):
        values = torch.arange(columns, dtype=torch.float32).view(1, 1, columns, 1) + 10 * columns
        for layer in cache.layers:
            layer.update(values, values)
    batch, joining = caches
    append_rows(batch, joining, 6)
    sliding, full = batch.layers[0], batch.layers[1]
    assert sliding.keys[:, 0, :, 0].tolist() == [[0, 20, 21], [63, 64, 65]] and sliding.cumulative_length == 6
    assert full.keys.shape[2] == 6
    select_rows(batch, [0], 2)  # the long row leaves: two columns remain
    assert sliding.keys[:, 0, :, 0].tolist() == [[20, 21]] and sliding.get_seq_length() == 2


def test_what_cannot_batch_says_why() -> None:
    for config in (GlmMoeDsaConfig(num_hidden_layers=2), GptOssConfig(num_hidden_layers=2), Qwen3NextConfig()):
        assert layer_refusal(DynamicCache(config=config)) is None and config_refusal(config) is None
    chunked = Llama4TextConfig(num_hidden_layers=4)
    assert "chunked attention" in config_refusal(chunked)
    cache = DynamicCache(config=chunked)
    cache.layers[0] = DummyLayer()
    assert "DummyLayer" in layer_refusal(cache) and layer_refusal(cache).startswith("continuous batching needs")
