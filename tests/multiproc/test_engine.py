"""Tests of the generation engine: two gloo rank processes with a sharded tiny Llama, and its in-process parts.

The two-rank tests run once per forward layout: `gather` (FSDP2 keeping the gathered layers) and
`tp` (tensor parallel over each rank's slices, with the demo model's uneven 9/3 heads).

The ranks are long-lived worker processes: a test sends each rank the name of a scenario
(a module-level function below) and its arguments, each rank runs it on its sharded model
and sends back plain data. Every exchange has a deadline, after which the ranks are killed
and the test fails, so a hang is a failure, never a stuck test run.
"""

from __future__ import annotations

import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.generation.streamers import TextIteratorStreamer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/tiny.py
from tiny import make_tiny_llama, make_tiny_mla, make_tiny_moe

from shardbook.rankd.generation import latent_attention
from shardbook.rankd.generation.engine import (
    MAX_STOP_CHARS,
    GenerationError,
    GenerationRequest,
    fit_max_new_tokens,
    generate,
)
from shardbook.rankd.generation.streaming import INCOMPLETE, TextDeltaStreamer
from tests.ranks import rank_context

pytestmark = pytest.mark.timeout(120)

WORLD_SIZE = 2
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
SMOLLM2 = "smollm2-135m-instruct"
DEADLINE_S = 60.0
"""Longest a scenario may take on the ranks before the test fails (the machine may be shared and slow)."""


# ----------------------------------------------------------------------------- rank side


def _rank_main(rank: int, init_file: str, model_path: str, layout: str, pg_timeout_s: float, conn: Any) -> None:
    """One rank: join the gloo group, load the model sharded,
    then run the scenarios the test sends until told to quit."""
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=WORLD_SIZE,
        timeout=datetime.timedelta(seconds=pg_timeout_s),
    )
    model, tokenizer = _load_sharded(model_path, layout)
    conn.send(("ready", None))
    while True:
        name, kwargs = conn.recv()
        if name == "quit":
            break
        try:
            conn.send(("ok", SCENARIOS[name](model, tokenizer, rank, **kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _load_sharded(model_path: str, layout: str) -> tuple[Any, Any]:
    """Every rank loads the checkpoint sharded over all ranks, in the forward layout `layout` ("tp+ep": experts too)."""
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    parallel = ParallelConfig(decode="tp", ep_size=WORLD_SIZE) if layout == "tp+ep" else ParallelConfig(decode=layout)
    config = ShardbookConfig(model=ModelConfig(model_name_or_path=model_path, dtype="float32"), parallel=parallel)
    loaded = load_sharded(config, device="cpu")
    return loaded.model, loaded.tokenizer


def _generate(model: Any, tokenizer: Any, rank: int, request: dict, **kwargs: Any) -> dict:
    """Run the engine the way a rank does (rank 0 streams, followers do not) and return the result with the chunks."""
    chunks: list[str] = []
    on_text = chunks.append if rank == 0 else None
    result = generate(
        model,
        tokenizer,
        GenerationRequest.from_dict(request),
        device="cpu",
        on_text=kwargs.pop("on_text", on_text),
        stop_event=kwargs.pop("stop_event", threading.Event()),
        **kwargs,
    )
    return {**result.to_dict(), "chunks": chunks}


def scenario_generate(model: Any, tokenizer: Any, rank: int, request: dict) -> dict:
    return _generate(model, tokenizer, rank, request)


def scenario_interrupt(
    model: Any, tokenizer: Any, rank: int, request: dict, stop_after: int, next_request: dict
) -> dict:
    """Interrupt mid-generation, at a different step on each rank, then generate again.

    Rank 0 is interrupted as the pool does it when the user interrupts (its `stop_event` set while
    the reply streams, here from `on_text` after `stop_after` chunks); a follower by its listener
    thread setting `stop_event`, here from a forward hook after `stop_after` forwards.
    """
    stop_event = threading.Event()
    chunks: list[str] = []
    num_forwards = {"n": 0}

    def count_and_stop(*_: Any) -> None:
        num_forwards["n"] += 1
        if num_forwards["n"] == stop_after:
            stop_event.set()

    def interrupt_after_chunks(text: str) -> None:
        chunks.append(text)
        if len(chunks) == stop_after:
            stop_event.set()

    hook = model.register_forward_hook(count_and_stop) if rank != 0 else None
    on_text = interrupt_after_chunks if rank == 0 else None
    try:
        interrupted = _generate(model, tokenizer, rank, request, on_text=on_text, stop_event=stop_event)
    finally:
        if hook is not None:
            hook.remove()
    interrupted["chunks"] = chunks
    return {"interrupted": interrupted, "next": _generate(model, tokenizer, rank, next_request)}


def scenario_fail(
    model: Any, tokenizer: Any, rank: int, request: dict, failing_rank: int, at_forward: int, how: str
) -> dict:
    """The fault-injection hook: a forward hook on `failing_rank` fails after `at_forward` forwards,
    by raising (`how="raise"`) or by ending the process (`how="exit"`, a crashed rank)."""
    counter = {"n": 0}

    def fail(*_: Any) -> None:
        counter["n"] += 1
        if counter["n"] == at_forward and how == "exit":
            os._exit(3)
        if counter["n"] == at_forward:
            raise RuntimeError(f"injected failure at forward {at_forward}")

    hook = model.register_forward_hook(fail) if rank == failing_rank else None
    start = time.perf_counter()
    try:
        _generate(model, tokenizer, rank, request, timeout_s=30.0)
        outcome = {"raised": None, "message": ""}
    except (GenerationError, TimeoutError) as exc:
        outcome = {"raised": type(exc).__name__, "message": str(exc)}
    finally:
        if hook is not None:
            hook.remove()
    return {**outcome, "seconds": time.perf_counter() - start}


def scenario_stop_in_prefill(model: Any, tokenizer: Any, rank: int, request: dict, stop_at_forward: int) -> dict:
    """Rank 1 is interrupted at its `stop_at_forward`-th forward (a prefill chunk); counts every rank's forwards."""
    stop_event, forwards = threading.Event(), {"n": 0}

    def count(*_: Any) -> None:
        forwards["n"] += 1
        if rank == 1 and forwards["n"] == stop_at_forward:
            stop_event.set()

    hook = model.register_forward_hook(count)
    start = time.perf_counter()
    try:
        result = _generate(model, tokenizer, rank, request, stop_event=stop_event)
    finally:
        hook.remove()
    return {**result, "forwards": forwards["n"], "seconds": time.perf_counter() - start}


SCENARIOS: dict[str, Callable[..., dict]] = {
    "stop_in_prefill": scenario_stop_in_prefill,
    "generate": scenario_generate,
    "interrupt": scenario_interrupt,
    "fail": scenario_fail,
}


# ----------------------------------------------------------------------------- test side


class Ranks:
    """Two rank processes, driven through pipes; every exchange has a deadline."""

    def __init__(
        self, model_path: Path, workdir: Path, *, pg_timeout_s: float, layout: str = "gather", target: Any = None
    ):
        context = rank_context()
        self.conns = []
        self.procs = []
        for rank in range(WORLD_SIZE):
            parent, child = context.Pipe()
            proc = context.Process(
                target=target or _rank_main,
                args=(rank, str(workdir / "pg-init"), str(model_path), layout, pg_timeout_s, child),
                daemon=True,
            )
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        started = self._receive_all(deadline_s=DEADLINE_S + 60, what="start-up")
        if any(answer is not None for answer in started):
            self.kill()
            pytest.fail(f"a rank died while starting: {started}")

    def run(self, scenario: str, per_rank: list[dict], *, deadline_s: float = DEADLINE_S) -> list[Any]:
        """Run `scenario` on every rank with that rank's arguments; return each rank's answer."""
        for conn, kwargs in zip(self.conns, per_rank):
            conn.send((scenario, kwargs))
        return self._receive_all(deadline_s=deadline_s, what=scenario)

    def close(self) -> None:
        for conn, proc in zip(self.conns, self.procs):
            if proc.is_alive():
                try:
                    conn.send(("quit", {}))
                except OSError:
                    pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
                proc.join()

    def kill(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.join()

    def _receive_all(self, *, deadline_s: float, what: str) -> list[Any]:
        deadline = time.monotonic() + deadline_s
        answers = []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                self.kill()
                pytest.fail(f"rank {rank} did not finish {what!r} within {deadline_s:.0f} s (hang?)")
            try:
                status, value = conn.recv()
            except EOFError:  # the rank's process ended
                self.procs[rank].join(timeout=10)
                answers.append({"exitcode": self.procs[rank].exitcode})
                continue
            if status == "error":
                pytest.fail(f"rank {rank} raised in {what!r}:\n{value}")
            answers.append(value)
        return answers


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """9 query heads over 3 KV heads, as the demo model: `tp` splits them unevenly (6 and 3)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module", params=["gather", "tp"])
def ranks(request: pytest.FixtureRequest, tiny_path: Path, tmp_path_factory: pytest.TempPathFactory):
    ranks = Ranks(tiny_path, tmp_path_factory.mktemp("ranks"), pg_timeout_s=60, layout=request.param)
    yield ranks
    ranks.close()


@pytest.fixture(scope="module")
def single(tiny_path: Path) -> tuple[Any, Any]:
    """The unsharded model in this process: a world of one rank."""
    return AutoModelForCausalLM.from_pretrained(tiny_path).eval(), AutoTokenizer.from_pretrained(tiny_path)


def _request(**overrides: Any) -> dict:
    return GenerationRequest(messages=QUESTION, **{"seed": 0, **overrides}).to_dict()


def _generate_here(model: Any, tokenizer: Any, request: dict) -> Any:
    return generate(
        model, tokenizer, GenerationRequest.from_dict(request), device="cpu", on_text=None, stop_event=threading.Event()
    )


def _token_ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


# ----------------------------------------------------------------------------- two ranks


def test_two_rank_greedy_matches_single_process(ranks: Ranks, single: tuple[Any, Any]) -> None:
    request = _request(max_new_tokens=20)
    expected = _generate_here(*single, request)
    answers = ranks.run("generate", [{"request": request}] * WORLD_SIZE)
    for rank, answer in enumerate(answers):
        assert answer["generated_tokens"] == expected.generated_tokens == 20, rank
        assert answer["text"] == expected.text, f"rank {rank} differs from the single process"
        assert answer["finish_reason"] == "length"
    assert "".join(answers[0]["chunks"]) == answers[0]["text"]
    assert answers[1]["chunks"] == []  # followers do not stream


def test_same_seed_samples_alike_on_every_rank(ranks: Ranks) -> None:
    request = _request(max_new_tokens=16, do_sample=True, temperature=1.5, top_k=0, top_p=1.0, seed=1234)
    answers = ranks.run("generate", [{"request": request}] * WORLD_SIZE)
    assert answers[0]["text"] == answers[1]["text"]
    assert answers[0]["seed"] == answers[1]["seed"] == 1234


def test_ranks_sampling_differently_still_finish(ranks: Ranks) -> None:
    """Ranks that disagree (different seeds and lengths) must not hang; the first rank done ends every rank's reply."""
    per_rank = [
        {"request": _request(do_sample=True, temperature=1.5, seed=1, max_new_tokens=4)},
        {"request": _request(do_sample=True, temperature=1.5, seed=2, max_new_tokens=24)},
    ]
    answers = ranks.run("generate", per_rank)
    assert [a["generated_tokens"] for a in answers] == [4, 4]
    assert "".join(answers[0]["chunks"]) == answers[0]["text"]


def test_interrupt_stops_every_rank_and_the_next_turn_works(ranks: Ranks, single: tuple[Any, Any]) -> None:
    request = _request(max_new_tokens=200)
    next_request = _request(max_new_tokens=12)
    per_rank = [
        {"request": request, "stop_after": 3, "next_request": next_request},
        {"request": request, "stop_after": 9, "next_request": next_request},
    ]
    answers = ranks.run("interrupt", per_rank)
    expected_next = _generate_here(*single, next_request)
    for rank, answer in enumerate(answers):
        assert answer["interrupted"]["finish_reason"] == "interrupted", rank
        assert answer["interrupted"]["generated_tokens"] < 20, rank
        assert answer["next"]["text"] == expected_next.text, rank
        assert answer["next"]["finish_reason"] == "length", rank
    rank0 = answers[0]["interrupted"]
    assert "".join(rank0["chunks"]) == rank0["text"]
    print("\ninterrupted at", [a["interrupted"]["generated_tokens"] for a in answers], "tokens on ranks 0, 1")


def test_a_follower_stopping_first_stops_rank_0_at_the_same_step(ranks: Ranks, single: tuple[Any, Any]) -> None:
    """Rank 1 sees the interrupt first (rank 0 never does): every rank ends at the same step, rank 0's reply
    a prefix of one process's (no step decoded from partial sums of a padding token)."""
    request = _request(max_new_tokens=40)
    per_rank = [
        {"request": request, "stop_after": 10**6, "next_request": _request(max_new_tokens=4)},
        {"request": request, "stop_after": 4, "next_request": _request(max_new_tokens=4)},
    ]
    answers = ranks.run("interrupt", per_rank)
    expected = _generate_here(*single, request)
    lengths = [a["interrupted"]["generated_tokens"] for a in answers]
    assert lengths[0] == lengths[1] < 40, lengths
    for rank, answer in enumerate(answers):
        assert answer["interrupted"]["finish_reason"] == "interrupted", rank
        assert expected.text.startswith(answer["interrupted"]["text"]), (rank, answer["interrupted"]["text"])


def test_expert_parallel_generation_matches_finishes_and_stops(tmp_path: Path) -> None:
    """Qwen3-MoE with ep_size 2: greedy equals one process; ranks sampling different lengths and an
    interrupt at different steps per rank end at the same step, the experts' all-reduce staying in step."""
    path = make_tiny_moe(tmp_path / "moe", "qwen3_moe")
    expected = _generate_here(
        AutoModelForCausalLM.from_pretrained(path).eval(),
        AutoTokenizer.from_pretrained(path),
        _request(max_new_tokens=12),
    )
    moe = Ranks(path, tmp_path, pg_timeout_s=60, layout="tp+ep")
    try:
        greedy = moe.run("generate", [{"request": _request(max_new_tokens=12)}] * WORLD_SIZE)
        lengths = moe.run(
            "generate",
            [
                {"request": _request(do_sample=True, temperature=1.5, seed=1, max_new_tokens=3)},
                {"request": _request(do_sample=True, temperature=1.5, seed=2, max_new_tokens=16)},
            ],
        )
        stopped = moe.run(
            "interrupt",
            [
                {
                    "request": _request(max_new_tokens=200),
                    "stop_after": stop,
                    "next_request": _request(max_new_tokens=12),
                }
                for stop in (3, 7)
            ],
        )
    finally:
        moe.close()
    assert [a["text"] for a in greedy] == [expected.text] * WORLD_SIZE
    assert [a["generated_tokens"] for a in lengths] == [3, 3]
    for answer in stopped:
        assert answer["interrupted"]["finish_reason"] == "interrupted"
        assert answer["next"]["text"] == expected.text


@pytest.mark.parametrize("layout", ["gather", "tp"])
def test_glm5_replies_over_its_latents_match_one_process_expanding_them(tmp_path: Path, layout: str, monkeypatch):
    """GLM-5 (MLA, the indexer's top-k) on two ranks, under FSDP2's gather and under tp: each rank's reply generated
    alone attends over the cached latents (the ranks' default) and equals one process that expands them as
    transformers does: the same tokens, each probability within 1e-5."""
    path = make_tiny_mla(tmp_path / "glm5", "glm_moe_dsa", index_n_heads=16)
    request = _request(max_new_tokens=8, want_scores=True)
    monkeypatch.setenv(latent_attention.SWITCH, "0")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)
    want = [(score.token_id, score.prob) for score in _generate_here(model, tokenizer, request).scores]
    monkeypatch.delenv(latent_attention.SWITCH)  # the ranks start without it
    glm5 = Ranks(path, tmp_path, pg_timeout_s=60, layout=layout)
    try:
        answers = glm5.run("generate", [{"request": request}] * WORLD_SIZE)
    finally:
        glm5.close()
    for rank, answer in enumerate(answers):
        got = [(score["token_id"], score["prob"]) for score in answer["scores"]]
        assert [token for token, _ in got] == [token for token, _ in want], rank
        assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= 1e-5, rank


def test_a_long_prefill_is_chunked_and_an_interrupt_stops_it_on_every_rank(tmp_path: Path) -> None:
    """A prompt of ~3,400 tokens under tp: forwarded in chunks of 512 (greedy still as one process), and an
    interrupt seen by rank 1 after its first chunk stops every rank before the next one."""
    from tiny import make_long_talker

    from shardbook.rankd.generation.engine import PREFILL_CHUNK

    path = make_long_talker(tmp_path / "long")
    messages = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog. " * 120}]
    request = GenerationRequest(messages=messages, seed=0, max_new_tokens=4).to_dict()
    expected = _generate_here(
        AutoModelForCausalLM.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path), request
    )
    long = Ranks(path, tmp_path, pg_timeout_s=60, layout="tp")
    try:
        whole = long.run("generate", [{"request": request}] * WORLD_SIZE)
        stopped = long.run("stop_in_prefill", [{"request": request, "stop_at_forward": 1}] * WORLD_SIZE)
    finally:
        long.close()
    assert expected.prompt_tokens > 4 * PREFILL_CHUNK
    assert [a["text"] for a in whole] == [expected.text] * WORLD_SIZE
    for rank, answer in enumerate(stopped):
        assert answer["finish_reason"] == "interrupted" and answer["generated_tokens"] == 0, (rank, answer)
        assert answer["forwards"] == 1, (rank, answer["forwards"])  # one chunk, then every rank stopped
    print("\nstopped in the prefill after", [round(a["seconds"], 2) for a in stopped], "s")


def test_exception_on_one_rank_surfaces_on_every_rank(tiny_path: Path, tmp_path: Path) -> None:
    """A rank that raises reports it with its rank; its peer, left waiting in a collective, errors out at the
    process group's timeout (5 s here) instead of hanging. The group is unusable afterwards."""
    rank0, rank1 = _fail_one_rank(tiny_path, tmp_path, how="raise")
    assert rank1["raised"] == "GenerationError"
    assert "rank 1" in rank1["message"] and "injected failure at forward 3" in rank1["message"]
    assert rank0["raised"] == "GenerationError", rank0
    assert "rank 0" in rank0["message"]
    assert rank0["seconds"] < 20


def test_a_crashed_rank_surfaces_on_the_others(tiny_path: Path, tmp_path: Path) -> None:
    """A rank whose process dies mid-generation: gloo sees the closed connection, the survivor raises at once."""
    rank0, rank1 = _fail_one_rank(tiny_path, tmp_path, how="exit")
    assert rank1 == {"exitcode": 3}
    assert rank0["raised"] == "GenerationError" and "rank 0" in rank0["message"], rank0
    assert rank0["seconds"] < 20


def _fail_one_rank(tiny_path: Path, tmp_path: Path, *, how: str) -> list[dict]:
    broken = Ranks(tiny_path, tmp_path, pg_timeout_s=5)
    try:
        request = _request(max_new_tokens=20)
        per_rank = [{"request": request, "failing_rank": 1, "at_forward": 3, "how": how}] * WORLD_SIZE
        answers = broken.run("fail", per_rank)
    finally:
        broken.close()
    for rank, answer in enumerate(answers):
        print(f"\n{how}: rank {rank}: {str(answer)[:300]}")
    return answers


# ----------------------------------------------------------------------------- in process


def test_prompt_longer_than_the_context_is_a_value_error(single: tuple[Any, Any]) -> None:
    model, tokenizer = single
    long_question = [{"role": "user", "content": "Paris is lovely. " * 200}]
    request = GenerationRequest(messages=long_question, seed=0)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        generate(model, tokenizer, request, device="cpu", on_text=None, stop_event=threading.Event())


def test_max_new_tokens_is_cut_to_the_context(single: tuple[Any, Any], caplog: pytest.LogCaptureFixture) -> None:
    model, _ = single
    context = model.config.max_position_embeddings
    assert fit_max_new_tokens(model, context - 10, 5) == 5
    assert fit_max_new_tokens(model, context - 10, 100) == 10
    assert "generating at most 10" in caplog.text


def test_scores_give_each_token_probability_and_alternatives(single: tuple[Any, Any]) -> None:
    result = _generate_here(*single, _request(max_new_tokens=5, want_scores=True))
    assert result.scores is not None and len(result.scores) == 5
    for score in result.scores:
        assert score.alternatives[0].token_id == score.token_id  # greedy takes the most likely
        assert 0 < score.prob <= 1 and len(score.alternatives) == 5


def test_request_needs_a_seed_and_rejects_unknown_keys(single: tuple[Any, Any]) -> None:
    request = GenerationRequest(messages=QUESTION)
    with pytest.raises(ValueError, match="with_seed"):
        generate(*single, request, device="cpu", on_text=None, stop_event=threading.Event())
    assert request.with_seed().seed is not None
    with pytest.raises(ValueError, match="valid keys are"):
        GenerationRequest.from_dict({**_request(), "temprature": 0.5})
    assert GenerationRequest.from_dict(_request()) == GenerationRequest(messages=QUESTION, seed=0)


def test_error_in_on_text_stops_generation_and_is_raised(single: tuple[Any, Any]) -> None:
    def broken_sink(text: str) -> None:
        raise OSError("display went away")

    with pytest.raises(OSError, match="display went away"):
        generate(
            *single,
            GenerationRequest.from_dict(_request(max_new_tokens=50)),
            device="cpu",
            on_text=broken_sink,
            stop_event=threading.Event(),
        )


# ----------------------------------------------------------------------------- streaming


MULTIBYTE = "法国的首都是巴黎。🚀 🎉 Paris 😀\n你好，世界！❤️ ok"


def _byte_token_ids(tokenizer: Any, text: str) -> list[int]:
    """One token per UTF-8 byte, so every multi-byte character is split across tokens."""
    return tokenizer.convert_tokens_to_ids([_BYTE_SYMBOLS[b] for b in text.encode("utf-8")])


def _byte_symbols() -> list[str]:
    """The byte-level BPE alphabet: printable Latin-1 bytes stand for themselves, the others for chr(256 + i)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    others = iter(range(256, 512))
    return [chr(b) if b in printable else chr(next(others)) for b in range(256)]


_BYTE_SYMBOLS = _byte_symbols()


@pytest.mark.parametrize("split", ["one token per byte", "tokenizer's own tokens"])
def test_streamer_sends_only_whole_characters(single: tuple[Any, Any], split: str) -> None:
    _, tokenizer = single
    ids = _byte_token_ids(tokenizer, MULTIBYTE) if split == "one token per byte" else _token_ids(tokenizer, MULTIBYTE)
    chunks: list[str] = []
    streamer = TextDeltaStreamer(tokenizer, chunks.append, skip_special_tokens=True)
    streamer.put(torch.tensor([[1, 2, 3]]))  # the prompt, skipped
    for token_id in ids:
        streamer.put(torch.tensor([token_id]))
    streamer.end()
    assert "".join(chunks) == MULTIBYTE
    assert not any(INCOMPLETE in chunk for chunk in chunks), chunks
    assert len(chunks) > 10  # streamed as it goes, not all at the end


def test_transformers_text_streamer_also_holds_back_split_characters(single: tuple[Any, Any]) -> None:
    """Checks the library fact: transformers' TextIteratorStreamer never sends a split character either
    (it holds text back to the last space, so it streams later than TextDeltaStreamer)."""
    _, tokenizer = single
    streamer = TextIteratorStreamer(tokenizer, skip_prompt=True)
    streamer.put(torch.tensor([[1]]))
    for token_id in _byte_token_ids(tokenizer, MULTIBYTE):
        streamer.put(torch.tensor([token_id]))
    streamer.end()
    chunks = list(streamer)
    assert "".join(chunks) == MULTIBYTE
    assert not any(INCOMPLETE in chunk for chunk in chunks)


def test_streamer_keeps_an_incomplete_character_that_never_completes(single: tuple[Any, Any]) -> None:
    _, tokenizer = single
    chunks: list[str] = []
    streamer = TextDeltaStreamer(tokenizer, chunks.append, skip_prompt=False)
    for token_id in _byte_token_ids(tokenizer, "ab") + _byte_token_ids(tokenizer, "🚀")[:2]:
        streamer.put(torch.tensor([token_id]))
    assert "".join(chunks) == "ab"
    streamer.end()
    assert "".join(chunks) == "ab" + tokenizer.decode(_byte_token_ids(tokenizer, "🚀")[:2])


# ----------------------------------------------------------------------------- the demo model


def _smollm2_path() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("shardbook")) / "models" / SMOLLM2


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.skipif(not (_smollm2_path() / "config.json").exists(), reason=f"demo model not built at {_smollm2_path()}")
@pytest.mark.parametrize("layout", ["gather", "tp"])
def test_demo_model_answers_paris_alike_on_two_ranks(tmp_path: Path, layout: str) -> None:
    path = _smollm2_path()
    request = _request(max_new_tokens=32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    expected = _generate_here(model, AutoTokenizer.from_pretrained(path), request)
    del model
    demo = Ranks(path, tmp_path, pg_timeout_s=120, layout=layout)
    try:
        answers = demo.run("generate", [{"request": request}] * WORLD_SIZE, deadline_s=240)
    finally:
        demo.close()
    assert "Paris" in expected.text
    for rank, answer in enumerate(answers):
        assert answer["text"] == expected.text, rank


def test_stop_strings_cut_the_reply_without_transformers_stop_string_set_up(
    single: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Stop strings are matched on the text by shardbook (no set-up per stop string on every rank), and are bounded."""
    import transformers.generation.stopping_criteria as criteria

    full = _generate_here(*single, _request(max_new_tokens=20))
    stop = full.text[6:9]
    cut = full.text.index(stop)

    def refuse(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("transformers' StopStringCriteria set-up ran (seconds for a long stop string)")

    monkeypatch.setattr(criteria.StopStringCriteria, "__init__", refuse)
    long_stop = "z" * MAX_STOP_CHARS
    stopped = _generate_here(*single, _request(max_new_tokens=20, stop=[long_stop, stop]))
    assert (stopped.text, stopped.finish_reason) == (full.text[:cut], "stop")
    assert stopped.generated_tokens < 20
    with pytest.raises(ValueError, match=f"stop: each stop string may have at most {MAX_STOP_CHARS} characters"):
        GenerationRequest(messages=QUESTION, stop=["x" * 10_000])
