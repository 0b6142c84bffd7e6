"""The KV cache reaches the model under the keyword its forward declares: `cache` from transformers 5.24
(where `past_key_values` warns, and is removed in 5.40), `past_key_values` before. One process, tiny models.
"""

from __future__ import annotations

import sys
import threading
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_long_talker, make_tiny_llama

from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest
from shardbook.rankd.generation.cache_keyword import cache_keyword
from shardbook.rankd.generation.engine import PREFILL_CHUNK, GenerationRequest, generate


def _cache_keyword_warnings(run) -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    return [str(w.message) for w in caught if "past_key_values" in str(w.message)]


def test_the_batch_passes_the_cache_by_the_forwards_own_keyword(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_llama(tmp_path / "tiny")
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32),
        AutoTokenizer.from_pretrained(path),
    )
    scheduler = BatchScheduler(tokenizer)
    ids = tokenizer("one two three")["input_ids"]
    handles = [scheduler.submit(SequenceRequest(prompt_ids=ids, max_new_tokens=3, ignore_eos=True)) for _ in range(2)]
    assert _cache_keyword_warnings(lambda: scheduler.run(model, "cpu")) == []
    assert [len(h.wait(10).token_ids) for h in handles] == [3, 3]


def test_the_chunked_prefill_and_generate_pass_the_cache_by_the_forwards_own_keyword(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_long_talker(tmp_path / "long")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 30}]
    request = GenerationRequest(messages=messages, seed=0, max_new_tokens=2)
    results = []
    run = lambda: results.append(  # noqa: E731
        generate(model, tokenizer, request, device="cpu", on_text=None, stop_event=threading.Event())
    )
    assert _cache_keyword_warnings(run) == []
    assert results[0].prompt_tokens > PREFILL_CHUNK and results[0].generated_tokens == 2


def test_a_forward_without_cache_gets_past_key_values(tmp_path: Path) -> None:
    """transformers before 5.24 declares only `past_key_values`: the name shardbook must pass there."""

    class Older(torch.nn.Module):
        def forward(self, input_ids=None, past_key_values=None, use_cache=None):
            return input_ids

    class Newer(torch.nn.Module):
        def forward(self, input_ids=None, cache=None, use_cache=None):
            return input_ids

    assert cache_keyword(Older()) == "past_key_values"
    assert cache_keyword(Newer()) == "cache"
