"""Who joins the batch when: an empty batch waits briefly for requests sent together (so they share its first
prefill forward), and the KV cache budget decides which requests may decode together and which never run.

One process (no process group: the plan is not broadcast), a tiny random llama, rank 0's scheduler.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_llama

from shardbook.rankd.generation import decode_attention, paged_layers
from shardbook.rankd.generation.batching import BatchLimitError, BatchScheduler, SequenceRequest
from shardbook.rankd.generation.paged_layers import PAGE_TOKENS


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _rows_of_each_forward(model, run) -> list[int]:
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    try:
        run()
    finally:
        hook.remove()
    return rows


def _forward_rows_of_three_staggered(model, tokenizer, join_window: float) -> list[int]:
    """Submit one request and start the loop; once the loop waits for arrivals, submit two more. The rows of
    every forward the loop ran."""
    scheduler = BatchScheduler(tokenizer, join_window=join_window)
    waiting, wait = threading.Event(), scheduler.arrived.wait

    def wait_and_say(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    scheduler.arrived.wait = wait_and_say
    request = SequenceRequest(prompt_ids=tokenizer("Hello there")["input_ids"], max_new_tokens=2, ignore_eos=True)

    def run() -> None:
        scheduler.submit(request)
        loop = threading.Thread(target=scheduler.run, args=(model, "cpu"))
        loop.start()
        assert waiting.wait(30), "the loop never waited for more arrivals"
        scheduler.submit(request)
        scheduler.submit(request)
        loop.join(60)
        assert not loop.is_alive()

    return _rows_of_each_forward(model, run)


def test_requests_sent_together_share_the_first_prefill(model_and_tokenizer) -> None:
    """Two requests reaching an idle batch while it waits after the first: one prefill forward of three rows,
    then a decode step of three rows (before the window, the first request was prefilled alone)."""
    model, tokenizer = model_and_tokenizer
    assert _forward_rows_of_three_staggered(model, tokenizer, join_window=1.0) == [3, 3]


def test_negative_join_window_is_refused(model_and_tokenizer) -> None:
    with pytest.raises(ValueError, match="join_window"):
        BatchScheduler(model_and_tokenizer[1], join_window=-1)


def _two_requests_under_a_budget(model, tokenizer, cache_tokens: int) -> tuple[list[int], list[int]]:
    """Two requests of 5 + 6 tokens each, submitted together: the rows of every forward, and each reply's length."""
    ids = tokenizer("one two three four five")["input_ids"][:5]
    assert len(ids) == 5
    scheduler = BatchScheduler(tokenizer, cache_tokens=(cache_tokens, "a test budget"))
    handles = [scheduler.submit(SequenceRequest(prompt_ids=ids, max_new_tokens=6, ignore_eos=True)) for _ in range(2)]
    rows = _rows_of_each_forward(model, lambda: scheduler.run(model, "cpu"))
    return rows, [len(h.wait(10).token_ids) for h in handles]


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "left-padded"])
def test_requests_decode_together_only_while_the_kv_cache_budget_holds_them(model_and_tokenizer, paged, monkeypatch):
    """Each request may reach 11 tokens of cache, one block of 16 when paged: with room for two they decode
    together, with one less one after the other (the second waits, it is not refused), and both replies are whole."""
    if paged and not decode_attention.available():
        pytest.skip("no C compiler here: nothing is paged")
    if not paged:
        monkeypatch.setenv(paged_layers.SWITCH, "0")
    model, tokenizer = model_and_tokenizer
    room = 2 * PAGE_TOKENS if paged else 22
    rows, lengths = _two_requests_under_a_budget(model, tokenizer, cache_tokens=room)
    assert rows == [2] * 6 and lengths == [6, 6], rows
    rows, lengths = _two_requests_under_a_budget(model, tokenizer, cache_tokens=room - 1)
    assert rows == [1] * 12 and lengths == [6, 6], rows


def test_a_paged_batch_holds_a_long_request_beside_short_ones_where_padding_would_not(model_and_tokenizer, monkeypatch):
    """Requests that reach 100 and 2 x 11 tokens under a budget of 160: paged, they take 112 + 2 x 16 and decode
    together; left-padded, three rows of 100 do not fit, so the short ones wait for the long one to end."""
    if not decode_attention.available():
        pytest.skip("no C compiler here: nothing is paged")
    model, tokenizer = model_and_tokenizer
    short = tokenizer("one two three four five")["input_ids"][:5]

    def rows_of_each_forward() -> list[int]:
        scheduler = BatchScheduler(tokenizer, cache_tokens=(160, "a test budget"))
        prompts = [(short * 18)[:90], short, short]
        for prompt, tokens in zip(prompts, (10, 6, 6)):
            scheduler.submit(SequenceRequest(prompt_ids=prompt, max_new_tokens=tokens, ignore_eos=True))
        return _rows_of_each_forward(model, lambda: scheduler.run(model, "cpu"))

    assert max(rows_of_each_forward()) == 3
    monkeypatch.setenv(paged_layers.SWITCH, "0")
    assert max(rows_of_each_forward()) == 2  # the long row, then the two short ones together


def test_a_request_beyond_the_kv_cache_budget_is_refused_before_it_runs(model_and_tokenizer) -> None:
    tokenizer = model_and_tokenizer[1]
    scheduler = BatchScheduler(tokenizer, cache_tokens=(10, "50% of rank 1's free memory"))
    with pytest.raises(
        BatchLimitError, match=r"needs 11 tokens of KV cache, but the batch may hold 10 \(50% of rank 1"
    ):
        scheduler.submit(SequenceRequest(prompt_ids=[1, 2, 3, 4, 5], max_new_tokens=6))
    assert scheduler.waiting == []
