"""An empty batch waits briefly for requests sent together, so they share its first prefill forward.

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

from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _forward_rows_of_three_staggered(model, tokenizer, join_window: float) -> list[int]:
    """Submit one request and start the loop; once the loop waits for arrivals, submit two more. The rows of
    every forward the loop ran."""
    rows: list[int] = []
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    scheduler = BatchScheduler(tokenizer, join_window=join_window)
    waiting, wait = threading.Event(), scheduler.arrived.wait

    def wait_and_say(timeout: float | None = None) -> bool:
        waiting.set()
        return wait(timeout)

    scheduler.arrived.wait = wait_and_say
    request = SequenceRequest(prompt_ids=tokenizer("Hello there")["input_ids"], max_new_tokens=2)
    try:
        scheduler.submit(request)
        loop = threading.Thread(target=scheduler.run, args=(model, "cpu"))
        loop.start()
        assert waiting.wait(30), "the loop never waited for more arrivals"
        scheduler.submit(request)
        scheduler.submit(request)
        loop.join(60)
        assert not loop.is_alive()
    finally:
        hook.remove()
    return rows


def test_requests_sent_together_share_the_first_prefill(model_and_tokenizer) -> None:
    """Two requests reaching an idle batch while it waits after the first: one prefill forward of three rows,
    then a decode step of three rows (before the window, the first request was prefilled alone)."""
    model, tokenizer = model_and_tokenizer
    assert _forward_rows_of_three_staggered(model, tokenizer, join_window=1.0) == [3, 3]


def test_negative_join_window_is_refused(model_and_tokenizer) -> None:
    with pytest.raises(ValueError, match="join_window"):
        BatchScheduler(model_and_tokenizer[1], join_window=-1)
