"""Rank 0's side of the continuous batch under faults: a row whose scores stop being numbers fails alone, the
bounds that keep sampling settings numbers, the reply text decoded incrementally, and stops by owner.

One process (no process group: the plan is not broadcast), a tiny random llama, rank 0's scheduler.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tiny import make_tiny_llama

from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest
from shardbook.rankd.generation.engine import GenerationRequest
from shardbook.rankd.generation.reply_text import DECODE_KWARGS
from shardbook.rankd.generation.streaming import IncrementalText

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["What is the capital of France?", "Hello", "Numbers: 0 1 2", "def add(a, b):"]


@pytest.fixture(scope="module")
def model_and_tokenizer(tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)


def _request(tokenizer, prompt: str, **settings) -> SequenceRequest:
    return SequenceRequest(prompt_ids=tokenizer(prompt)["input_ids"], ignore_eos=True, **settings)


def _run(model, tokenizer, requests: list[SequenceRequest], **submit) -> list:
    scheduler = BatchScheduler(tokenizer)
    handles = [scheduler.submit(r, **submit) for r in requests]
    scheduler.run(model, "cpu")
    return [h.wait(0) for h in handles]


def _unchecked(request: SequenceRequest, **fields) -> SequenceRequest:
    """`request` with settings its own checks refuse (a request the bounds would let through, were they wider)."""
    for name, value in fields.items():
        object.__setattr__(request, name, value)
    return request


@pytest.mark.parametrize("overflowing", [{"temperature": 1e-39}, {"repetition_penalty": 1e-39}])
def test_a_row_whose_scores_overflow_fails_alone_beside_three_healthy_ones(model_and_tokenizer, overflowing) -> None:
    model, tokenizer = model_and_tokenizer
    healthy = [_request(tokenizer, p, max_new_tokens=8, do_sample=True, seed=i) for i, p in enumerate(PROMPTS[1:])]
    alone = [_run(model, tokenizer, [r])[0] for r in healthy]
    bad = _unchecked(_request(tokenizer, PROMPTS[0], max_new_tokens=8, do_sample=True), **overflowing)
    results = _run(model, tokenizer, [healthy[0], bad, *healthy[1:]])
    assert results[1].finish_reason == "error" and "not numbers" in results[1].error, results[1]
    others = [results[0], *results[2:]]
    assert [(r.finish_reason, r.token_ids) for r in others] == [(a.finish_reason, a.token_ids) for a in alone]
    assert all(r.finish_reason == "length" for r in others)


def test_a_row_of_not_a_number_logits_fails_alone(model_and_tokenizer) -> None:
    """The model gives one row not-a-number logits (greedy): that sequence ends with an error, the others go on."""
    model, tokenizer = model_and_tokenizer
    requests = [_request(tokenizer, p, max_new_tokens=6) for p in PROMPTS]
    poisoned = requests[2].prompt_ids[-1]

    def nan_row(_module, args, kwargs, out):
        if kwargs["input_ids"].shape[1] > 1:  # the prefill: its rows are the prompts, each ending at its last token
            out.logits[(kwargs["input_ids"][:, -1] == poisoned).nonzero().view(-1)] = float("nan")
        return out

    alone = _run(model, tokenizer, [requests[0]])[0]
    hook = model.register_forward_hook(nan_row, with_kwargs=True)
    try:
        results = _run(model, tokenizer, requests)
    finally:
        hook.remove()
    assert results[2].finish_reason == "error" and "not-a-number" in results[2].error
    assert (results[0].finish_reason, results[0].token_ids) == ("length", alone.token_ids)
    assert [r.finish_reason for r in results] == ["length", "length", "error", "length"]


@pytest.mark.parametrize(
    "settings, field",
    [
        ({"do_sample": True, "temperature": 1e-39}, "temperature"),
        ({"do_sample": True, "temperature": float("inf")}, "temperature"),
        ({"repetition_penalty": 1e-39}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"repetition_penalty": float("nan")}, "repetition_penalty"),
    ],
)
def test_sampling_settings_are_bounded_where_they_stop_being_numbers(settings, field) -> None:
    with pytest.raises(ValueError, match=f"^{field} must be"):
        SequenceRequest(prompt_ids=[1, 2], **settings)
    with pytest.raises(ValueError, match=f"^{field} must be"):
        GenerationRequest(messages=[{"role": "user", "content": "hi"}], **settings)


@pytest.mark.parametrize(
    "fields, param",
    [({"temperature": 1e-39}, "temperature"), ({"repetition_penalty": 1e-39}, "repetition_penalty")],
)
def test_completions_refuse_settings_that_overflow_with_a_400_naming_them(fields, param) -> None:
    import json

    from shardbook.kernel.server.openai_api import ApiError
    from shardbook.kernel.server.text_completions import parse_text_request

    with pytest.raises(ApiError) as e:
        parse_text_request(json.dumps({"model": "m", "prompt": "hi", **fields}).encode())
    assert e.value.status == 400 and e.value.param == param and "must be" in str(e.value)


def test_sampling_bounds_keep_ordinary_settings() -> None:
    SequenceRequest(prompt_ids=[1], do_sample=True, temperature=0.01, repetition_penalty=1.3)
    SequenceRequest(prompt_ids=[1], temperature=1e-30)  # greedy: the temperature is not used


TEXTS = ["你好，世界 and emoji 😀🎉 mixed", "def add(a, b):\n    return a + b\n", "  spaces   and\n\nnewlines é"]


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_the_whole_decode_after_every_token(model_and_tokenizer, text) -> None:
    tokenizer = model_and_tokenizer[1]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    calls: list[int] = []

    def decode(tokens: list[int]) -> str:
        calls.append(len(tokens))
        return tokenizer.decode(tokens, **DECODE_KWARGS)

    incremental = IncrementalText(decode)
    for n in range(1, len(ids) + 1):
        incremental.update(ids[:n])
        whole = tokenizer.decode(ids[:n], **DECODE_KWARGS)
        assert incremental.decoded + incremental.pending == whole, n
        assert incremental.tail(max(0, len(whole) - 3)) == whole[-3:]
    assert max(calls) < 8  # only the newest tokens are decoded, never the whole reply
    assert incremental.restarts == 0


def test_a_reply_is_decoded_a_few_tokens_at_a_time_and_once_whole_at_its_end(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    lengths: list[int] = []

    class Counting:
        def decode(self, ids, **kwargs):
            lengths.append(len(ids))
            return tokenizer.decode(ids, **kwargs)

        def __getattr__(self, name):  # the vocabulary and special tokens the reply's decoder reads
            return getattr(tokenizer, name)

    chunks: list[str] = []
    scheduler = BatchScheduler(Counting())
    handle = scheduler.submit(_request(tokenizer, PROMPTS[0], max_new_tokens=40, stop=["zzz"]), on_text=chunks.append)
    scheduler.run(model, "cpu")
    result = handle.wait(0)
    assert result.generated_tokens == 40 and "".join(chunks) == result.text
    # The whole reply is decoded once, at the end; before, only the tokens since the last whole character and the
    # piece before them (a random model's runs of stray bytes make that a dozen tokens at most here).
    assert lengths[-1] == 40 and max(lengths[:-1]) < 20, lengths


def _split_stop(tokenizer, tokens: list[int]) -> tuple[str, int]:
    """A stop string made of the end of one token's text and the start of the next's, and that next token's index."""
    for k in range(1, len(tokens) - 1):
        before = tokenizer.decode(tokens[:k], **DECODE_KWARGS)
        after = tokenizer.decode(tokens[: k + 1], **DECODE_KWARGS)
        stop = after[len(before) - 2 : len(before) + 2]
        if len(before) >= 2 and after.startswith(before) and len(stop) == 4 and "\ufffd" not in stop:
            if after.find(stop) == len(before) - 2:
                return stop, k
    pytest.skip("no two tokens of this reply make a stop string")


def test_a_stop_string_split_across_tokens_ends_the_reply_at_the_token_that_completes_it(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    free = _run(model, tokenizer, [_request(tokenizer, PROMPTS[1], max_new_tokens=24)])[0]
    stop, k = _split_stop(tokenizer, free.token_ids)
    chunks: list[str] = []
    stopped = _run(
        model, tokenizer, [_request(tokenizer, PROMPTS[1], max_new_tokens=24, stop=[stop])], on_text=chunks.append
    )[0]
    whole = tokenizer.decode(free.token_ids, **DECODE_KWARGS)
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[: k + 1]
    assert stopped.text == whole[: whole.find(stop)] and "".join(chunks) == stopped.text


def test_streamed_chunks_join_into_the_reply(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    requests = [_request(tokenizer, p, max_new_tokens=20, stop=["zz"]) for p in PROMPTS]
    chunks: dict[int, list[str]] = {i: [] for i in range(len(requests))}
    scheduler = BatchScheduler(tokenizer)
    handles = [scheduler.submit(r, on_text=chunks[i].append) for i, r in enumerate(requests)]
    scheduler.run(model, "cpu")
    for i, handle in enumerate(handles):
        result = handle.wait(0)
        assert "".join(chunks[i]) == result.text and result.finish_reason in ("stop", "length")


def test_stop_owned_stops_that_owners_sequences_only(model_and_tokenizer) -> None:
    model, tokenizer = model_and_tokenizer
    scheduler = BatchScheduler(tokenizer)
    request = _request(tokenizer, PROMPTS[1], max_new_tokens=6)
    handles = {owner: [scheduler.submit(request, owner=owner) for _ in range(2)] for owner in ("cell", "server")}
    unowned = scheduler.submit(request)
    stopped: list[int] = []

    def stop_at_the_first_decode(_module, _args, kwargs) -> None:
        if kwargs["input_ids"].shape[1] == 1 and not stopped:  # every sequence runs, none has finished
            stopped.extend([scheduler.stop_owned(None), scheduler.stop_owned("cell")])

    hook = model.register_forward_pre_hook(stop_at_the_first_decode, with_kwargs=True)
    try:
        scheduler.run(model, "cpu")
    finally:
        hook.remove()
    assert stopped == [0, 2]
    assert [h.wait(0).finish_reason for h in handles["cell"]] == ["interrupted"] * 2
    assert [h.wait(0).finish_reason for h in handles["server"] + [unowned]] == ["length"] * 3


def test_a_cells_submission_is_that_cells_and_another_threads_nobodys(model_and_tokenizer, monkeypatch) -> None:
    """And while an intervention is set, the interventions apply to the cell's sequence, not to the other's."""
    import threading
    from types import SimpleNamespace

    from shardbook.kernel.api import batch
    from shardbook.kernel.ranks import foreground
    from shardbook.rankd.generation import intervention_state
    from shardbook.rankd.inspection import interventions

    model, tokenizer = model_and_tokenizer
    scheduler = BatchScheduler(tokenizer)
    scheduler.running = True  # a loop runs already: submit starts none
    scheduler.loaded = SimpleNamespace(model=model)
    monkeypatch.setattr(batch, "scheduler_for", lambda runtime: scheduler)
    request = SequenceRequest(prompt_ids=[1, 2], max_new_tokens=2)
    foreground.cell_started()
    cell, other_thread = foreground.running_cell(), []
    intervention_state.registry(model)["steer"] = intervention_state.Intervention("steer", [], on_input=False)
    try:
        own = batch.submit(None, request)
        thread = threading.Thread(target=lambda: other_thread.append(batch.submit(None, request)))
        thread.start()
        thread.join(30)
    finally:
        interventions.remove(model, None)
        foreground.cell_ended()
    assert cell is not None and own.owner is cell and other_thread[0].owner is None
    assert own.request.intervene and not other_thread[0].request.intervene
    assert foreground.running_cell() is None and scheduler.stop_owned(foreground.running_cell()) == 0
    assert scheduler.stop_owned(cell) == 1 and own.stop_requested.is_set()
    assert not other_thread[0].stop_requested.is_set()


def test_the_stop_button_spares_an_http_requests_turn() -> None:
    from shardbook.kernel.ranks.generation_queue import HTTP_SOURCE, GenerationQueue

    queue, stopped = GenerationQueue(), []
    turn = queue.enter(HTTP_SOURCE)
    turn.on_stop = lambda: stopped.append(turn)
    assert turn.wait()
    assert queue.stop_running(spare=(HTTP_SOURCE,)) is None and not stopped
    assert queue.stop_running() is turn and stopped == [turn]


def test_a_chunk_of_a_long_prompt_that_raises_fails_only_that_prompt(model_and_tokenizer) -> None:
    """A prompt longer than a step (`max_step_tokens` 16) is prefilled a chunk per step; when its second chunk's
    forward raises, that request fails, its cache is dropped, and the running rows and the request waiting
    behind it decode as they do without the fault."""
    model, tokenizer = model_and_tokenizer
    long_ids = tokenizer(" ".join([PROMPTS[0]] * 20))["input_ids"][:100]
    running = [_request(tokenizer, p, max_new_tokens=12) for p in PROMPTS[1:3]]
    behind = _request(tokenizer, PROMPTS[3], max_new_tokens=6)
    requests = [*running, SequenceRequest(prompt_ids=long_ids, max_new_tokens=4, ignore_eos=True), behind]

    def run() -> list:
        scheduler = BatchScheduler(tokenizer, max_step_tokens=16)
        handles = [scheduler.submit(r) for r in requests]
        scheduler.run(model, "cpu")
        return [h.wait(0) for h in handles]

    def raise_on_the_second_chunk(_module, _args, kwargs) -> None:
        ids = kwargs["input_ids"]
        if ids.shape == (1, 14) and int(kwargs["position_ids"][0, 0]) == 14:
            raise RuntimeError("the second chunk failed")

    clean = run()
    hook = model.register_forward_pre_hook(raise_on_the_second_chunk, with_kwargs=True)
    try:
        faulty = run()
    finally:
        hook.remove()
    assert [r.finish_reason for r in clean] == ["length"] * 4
    assert faulty[2].finish_reason == "error" and "the second chunk failed" in faulty[2].error, faulty[2]
    assert "the prefill of the joining prompts failed" in faulty[2].error
    others = [0, 1, 3]
    assert [(faulty[i].finish_reason, faulty[i].token_ids) for i in others] == [
        (clean[i].finish_reason, clean[i].token_ids) for i in others
    ]
