"""Chunked prefill on two gloo ranks: a prompt longer than a step's room joins a running batch a chunk per step.

A tiny llama (context 256) with `max_step_tokens` 16, so a 100-token prompt is long: every step the two
running rows decode one token and the long prompt takes the step's other 14 tokens, into its own cache, until
its last chunk joins the batch. Each reply is compared with the same request decoded alone in one prefill
forward (float32; log-probabilities within 1e-4, tokens up to the first near-tie of the solo reply). Steps are
counted from the forwards every rank ran, never timed.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest

from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)

MAX_STEP_TOKENS = 16
LONG_TOKENS = 100
RUNNING = ["What is the capital of France?", "Hello"]
BEHIND = "def add(a, b):"
"""Waits behind the long prompt, and joins once it is stopped."""
TIE = 1e-4
"""Log-probability gap under which the solo reply's top two tokens count as a tie."""


def _long_ids(tokenizer: Any, count: int = LONG_TOKENS) -> list[int]:
    text = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps."] * (count // 10 + 2))
    ids = tokenizer(text)["input_ids"][:count]
    assert len(ids) == count
    return ids


def _scenarios(rank: int, path: Path, layout: str) -> dict[str, Any]:
    """Every rank runs the same batches (rank 0 leads, the follower follows); each batch's results on rank 0 and
    the forwards of every rank: (rows, columns, whether it is a chunk of the long prompt)."""
    import torch

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode=layout)
    )
    loaded = load_sharded(config, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    long_ids = _long_ids(tokenizer)
    long_request = SequenceRequest(
        prompt_ids=long_ids, max_new_tokens=8, ignore_eos=True, prompt_logprobs=True, logprobs=2
    )

    def short(prompt: str) -> SequenceRequest:
        return SequenceRequest(
            prompt_ids=tokenizer(prompt)["input_ids"], max_new_tokens=24, ignore_eos=True, logprobs=2
        )

    def is_chunk(kwargs: dict) -> bool:
        ids, start = kwargs["input_ids"], int(kwargs["position_ids"][0, 0])
        return ids.shape[0] == 1 and ids[0].tolist() == long_ids[start : start + ids.shape[1]]

    def batch(requests: list[SequenceRequest], stop_long_at_chunk: int | None = None, **limits) -> dict:
        forwards: list[tuple[int, int, bool]] = []
        handles: list[Any] = []

        def record(_module, _args, kwargs) -> None:
            forwards.append((*kwargs["input_ids"].shape, is_chunk(kwargs)))
            chunks = sum(f[2] for f in forwards)
            if rank == 0 and forwards[-1][2] and chunks == stop_long_at_chunk:  # stopped while this chunk runs
                next(h for h in handles if h.request is long_request).stop()

        hook = model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            if rank != 0:
                return {"steps": follow_batch(model, "cpu"), "forwards": forwards}
            scheduler = BatchScheduler(tokenizer, context=256, **limits)
            handles.extend(scheduler.submit(r) for r in requests)
            steps = scheduler.run(model, "cpu")
        finally:
            hook.remove()
        results = [h.wait(0) for h in handles]
        return {"steps": steps, "forwards": forwards, "results": [_shape(r) for r in results]}

    with torch.no_grad():
        running = [short(p) for p in RUNNING]
        behind = short(BEHIND)
        return {
            "long_tokens": len(long_ids),
            "solo_long": batch([long_request]),
            "solo": [batch([r]) for r in [*running, behind]],
            "together": batch([*running, long_request], max_step_tokens=MAX_STEP_TOKENS),
            "stopped": batch([*running, long_request, behind], stop_long_at_chunk=2, max_step_tokens=MAX_STEP_TOKENS),
        }


PAPER_TOKENS = 10_000
PAPER_STEP_TOKENS = 1024
PAPER_CONTEXT = 10_240


def _paper_scenarios(rank: int, path: Path) -> dict[str, Any]:
    """A 10,000-token prompt under `tp`: alone in one forward, then submitted once the running rows stream, with
    `max_step_tokens` 1024, and once more stopped while its third chunk runs. Every rank's forwards, as above."""
    import torch

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode="tp")
    )
    loaded = load_sharded(config, device="cpu")
    model, tokenizer = loaded.model, loaded.tokenizer
    paper = _long_ids(tokenizer, PAPER_TOKENS)

    def request(ids: list[int], tokens: int) -> SequenceRequest:
        return SequenceRequest(prompt_ids=ids, max_new_tokens=tokens, ignore_eos=True, logprobs=2)

    def batch(running: list[str], late_after: int | None = None, stop_at_chunk: int | None = None, **limits) -> dict:
        """Run `running` (and the paper, at once or once row 0 streamed `late_after` pieces) on every rank."""
        forwards: list[tuple[int, int, bool]] = []
        long_request, handles, streamed = request(paper, 4), [], []

        def record(_module, _args, kwargs) -> None:
            ids, start = kwargs["input_ids"], int(kwargs["position_ids"][0, 0])
            chunk = ids.shape[0] == 1 and ids[0].tolist() == paper[start : start + ids.shape[1]]
            forwards.append((*ids.shape, chunk))
            if rank == 0 and chunk and sum(f[2] for f in forwards) == stop_at_chunk:
                handles[-1].stop()

        def join_late(piece: str) -> None:
            streamed.append(piece)
            if len(streamed) == late_after:
                handles.append(scheduler.submit(long_request))

        hook = model.register_forward_pre_hook(record, with_kwargs=True)
        try:
            if rank != 0:
                return {"steps": follow_batch(model, "cpu"), "forwards": forwards}
            scheduler = BatchScheduler(tokenizer, context=PAPER_CONTEXT, **limits)
            for i, prompt in enumerate(running):
                on_text = join_late if i == 0 and late_after else None
                handles.append(scheduler.submit(request(tokenizer(prompt)["input_ids"], 24), on_text=on_text))
            if late_after is None:
                handles.append(scheduler.submit(long_request))
            steps = scheduler.run(model, "cpu")
        finally:
            hook.remove()
        return {"steps": steps, "forwards": forwards, "results": [_shape(h.wait(0)) for h in handles]}

    with torch.no_grad():
        return {
            "solo_paper": batch([], max_step_tokens=PAPER_TOKENS),
            "solo": [batch([p]) for p in RUNNING],
            "together": batch(RUNNING, late_after=3, max_step_tokens=PAPER_STEP_TOKENS),
            "stopped": batch(RUNNING, late_after=3, stop_at_chunk=3, max_step_tokens=PAPER_STEP_TOKENS),
        }


def _shape(result: Any) -> dict:
    return {
        "tokens": result.token_ids,
        "finish_reason": result.finish_reason,
        "token_logprobs": result.token_logprobs,
        "top_logprobs": result.top_logprobs,
        "prompt_logprobs": result.prompt_logprobs,
        "error": result.error,
    }


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module", params=["gather", "tp"])
def answer(request: pytest.FixtureRequest, llama_path: Path) -> dict:
    from tests.ranks import run_ranks

    leader, follower = run_ranks(_scenarios, llama_path, request.param, deadline=240)
    for name in ("solo_long", "together", "stopped"):  # the follower ran every step rank 0 planned, alike
        assert follower[name]["steps"] == leader[name]["steps"], name
        assert follower[name]["forwards"] == leader[name]["forwards"], name
    return leader


def _same_reply(got: dict, alone: dict) -> None:
    """`got` equals the solo reply: its tokens up to the first near-tie of the solo reply's top two (and the
    token there is one of the two), every log-probability taken up to there within 1e-4."""
    assert got["finish_reason"] == alone["finish_reason"] and got["error"] is None
    tied = len(alone["tokens"])
    for i, tops in enumerate(alone["top_logprobs"]):
        best = sorted(tops.values(), reverse=True)
        if len(best) > 1 and best[0] - best[1] < TIE:
            tied = i
            break
    assert got["tokens"][:tied] == alone["tokens"][:tied]
    assert got["token_logprobs"][:tied] == pytest.approx(alone["token_logprobs"][:tied], abs=1e-4)
    if tied < len(alone["tokens"]):
        assert got["tokens"][tied] in alone["top_logprobs"][tied]
    if alone["prompt_logprobs"] is not None:
        assert got["prompt_logprobs"][0] is None and alone["prompt_logprobs"][0] is None
        assert got["prompt_logprobs"][1:] == pytest.approx(alone["prompt_logprobs"][1:], abs=1e-4)


def test_a_long_prompt_joins_a_running_batch_a_chunk_per_step_and_equals_its_solo_reply(answer: dict) -> None:
    together, n = answer["together"], answer["long_tokens"]
    room = MAX_STEP_TOKENS - len(RUNNING)  # the running rows take one token of each step
    forwards = together["forwards"]
    chunks = [i for i, (_, _, chunk) in enumerate(forwards) if chunk]
    assert [forwards[i][:2] for i in chunks] == [(1, room)] * (n // room) + [(1, n % room)], forwards
    assert len(chunks) == math.ceil(n / room)
    # Every step of the long prefill, the running rows decoded a token first (the chunk never stalls them);
    # after the last chunk the long prompt decodes beside them.
    assert all(forwards[i - 1][:2] == (len(RUNNING), 1) for i in chunks), forwards
    assert forwards[chunks[-1] + 1][:2] == (len(RUNNING) + 1, 1), forwards
    assert answer["solo_long"]["forwards"][0][:2] == (1, n)  # alone, with the default limit: one forward
    long_reply = together["results"][len(RUNNING)]
    assert len(long_reply["tokens"]) == 8 and len(long_reply["prompt_logprobs"]) == n
    _same_reply(long_reply, answer["solo_long"]["results"][0])
    for got, alone in zip(together["results"][: len(RUNNING)], answer["solo"]):
        _same_reply(got, alone["results"][0])


def test_stopping_a_long_prefill_stops_it_within_one_chunk(answer: dict) -> None:
    stopped = answer["stopped"]
    chunks = [f for f in stopped["forwards"] if f[2]]
    assert len(chunks) == 2  # stopped while its second chunk ran: that chunk was its last
    long_reply = stopped["results"][len(RUNNING)]
    assert long_reply["finish_reason"] == "interrupted" and long_reply["tokens"] == []
    # The running rows went on, and the request waiting behind the long prompt joined once it was dropped.
    for got, alone in zip(stopped["results"][: len(RUNNING)] + stopped["results"][-1:], answer["solo"]):
        _same_reply(got, alone["results"][0])


def test_a_prompt_beyond_the_models_context_is_refused_and_a_long_one_is_not(llama_path: Path) -> None:
    from transformers import AutoTokenizer

    from shardbook.rankd.generation.batching import BatchLimitError, BatchScheduler, SequenceRequest

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    scheduler = BatchScheduler(tokenizer, max_step_tokens=4, context=256)
    scheduler.submit(SequenceRequest(prompt_ids=[1] * 256, max_new_tokens=1))  # 64 steps' room: chunked, accepted
    with pytest.raises(BatchLimitError, match=r"the prompt has 257 tokens but the model's context is 256 tokens"):
        scheduler.submit(SequenceRequest(prompt_ids=[1] * 257, max_new_tokens=1))
    with pytest.raises(BatchLimitError, match="exceeds the model's context of 256 tokens") as refused:
        scheduler.submit(SequenceRequest(prompt_ids=[1] * 200, max_new_tokens=100))
    assert refused.value.param == "max_tokens"
    assert len(scheduler.waiting) == 1


def test_a_10000_token_prompt_joins_a_running_batch_while_its_rows_get_a_token_per_chunk(tmp_path: Path) -> None:
    """The issue's case: a paper-sized prompt (a tiny llama with a context of 10,240 positions) joins two rows
    that are decoding. Counted in forwards: each step of its prefill is one decode of the running rows, then one
    chunk of at most a step's room, so no row waits more than one chunk for its next token. Its reply equals
    the one it gets prefilled alone in one forward; the stop ends its prefill within the chunk that runs."""
    from tests.ranks import run_ranks

    path = make_tiny_llama(
        tmp_path / "paper", hidden_size=16, num_heads=2, num_kv_heads=2, max_position_embeddings=PAPER_CONTEXT
    )
    leader, follower = run_ranks(_paper_scenarios, path, deadline=240)
    for name in ("solo_paper", "together", "stopped"):
        assert follower[name]["forwards"] == leader[name]["forwards"], name
    assert leader["solo_paper"]["forwards"][0][:2] == (1, PAPER_TOKENS)

    forwards = leader["together"]["forwards"]
    chunks = [i for i, (_, _, chunk) in enumerate(forwards) if chunk]
    room = PAPER_STEP_TOKENS - len(RUNNING)
    assert len(chunks) == math.ceil(PAPER_TOKENS / room) and sum(forwards[i][1] for i in chunks) == PAPER_TOKENS
    assert all(forwards[i][1] <= room for i in chunks)
    assert forwards[: chunks[0]].count((len(RUNNING), 1, False)) >= 2  # the rows were decoding when it came
    between = [forwards[i - 1][:2] for i in chunks]  # the forward before each chunk: the rows' decode
    assert between == [(len(RUNNING), 1)] * len(chunks), forwards
    assert all(b - a == 2 for a, b in zip(chunks, chunks[1:])), forwards  # nothing else between two chunks
    assert forwards[chunks[-1] + 1][:2] == (len(RUNNING) + 1, 1)  # then it decodes beside them
    *rows, paper = leader["together"]["results"]
    assert len(paper["tokens"]) == 4
    _same_reply(paper, leader["solo_paper"]["results"][0])
    for got, alone in zip(rows, leader["solo"]):
        _same_reply(got, alone["results"][0])

    stopped = leader["stopped"]
    assert sum(f[2] for f in stopped["forwards"]) == 3  # stopped while its third chunk ran: no fourth
    *rows, paper = stopped["results"]
    assert paper["finish_reason"] == "interrupted" and paper["tokens"] == []
    for got, alone in zip(rows, leader["solo"]):
        _same_reply(got, alone["results"][0])
