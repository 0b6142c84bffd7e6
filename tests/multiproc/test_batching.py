"""Continuous batching on two gloo ranks: rank 0 plans every step, the follower executes the broadcast plans.

Every reply decoded in a batch must equal the reply the same request gets alone (greedy, float32),
under `gather`, `reshard`, `tp`, and `tp` with experts on a tiny MoE.
"""

from __future__ import annotations

import datetime
import sys
import traceback
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_engine import WORLD_SIZE, Ranks, _load_sharded
from tiny import make_tiny_llama, make_tiny_moe

pytestmark = pytest.mark.timeout(300)

PROMPTS = [
    "What is the capital of France?",
    "Hello",
    "The quick brown fox jumps over the lazy dog while",
    "Numbers: 0 1 2",
    "def add(a, b):",
    "你好，世界",
    "Emoji time",
    "Sharded models keep one slice",
]


def _batch_rank_main(rank: int, init_file: str, model_path: str, layout: str, pg_timeout_s: float, conn: Any) -> None:
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
            conn.send(("ok", _scenario_batch(model, tokenizer, rank, **kwargs)))
        except Exception:
            conn.send(("error", traceback.format_exc()))
    dist.destroy_process_group()


def _scenario_batch(
    model: Any,
    tokenizer: Any,
    rank: int,
    requests: list[dict],
    late: list[dict] | None = None,
    stop_after: dict[int, int] | None = None,
    limits: dict | None = None,
) -> Any:
    """Rank 0 submits `requests` (and each of `late` once request `after[0]` streamed `after[1]` chunks;
    request i is stopped after `stop_after[i]` chunks) and runs the loop; the follower follows."""
    from shardbook.rankd.generation.batching import follow_batch

    forwards: list[tuple[int, int]] = []  # (rows, columns) of every forward's input ids, on this rank
    hook = model.register_forward_pre_hook(
        lambda _m, _a, kwargs: forwards.append(tuple(kwargs["input_ids"].shape)), with_kwargs=True
    )
    try:
        if rank != 0:
            return {"steps": follow_batch(model, "cpu"), "forwards": forwards}
        return {**_lead_batch(model, tokenizer, requests, late, stop_after, limits), "forwards": forwards}
    finally:
        hook.remove()


def _lead_batch(
    model: Any,
    tokenizer: Any,
    requests: list[dict],
    late: list[dict] | None,
    stop_after: dict[int, int] | None,
    limits: dict | None,
) -> dict:
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest

    scheduler = BatchScheduler(tokenizer, **(limits or {}))
    eos = [tokenizer.eos_token_id]
    handles: list[Any] = []
    late_handles: list[Any] = []
    counts: dict[int, int] = {}

    def make(spec: dict) -> SequenceRequest:
        spec = dict(spec)
        return SequenceRequest(prompt_ids=tokenizer(spec.pop("prompt"))["input_ids"], eos_ids=eos, **spec)

    def on_text_for(i: int):
        def on_text(chunk: str) -> None:
            counts[i] = counts.get(i, 0) + 1
            for spec in late or []:
                if tuple(spec["after"]) == (i, counts[i]):
                    late_handles.append(scheduler.submit(make(spec["request"])))
            if (stop_after or {}).get(i) == counts[i]:
                handles[i].stop()

        return on_text

    for i, spec in enumerate(requests):
        handles.append(scheduler.submit(make(spec), on_text=on_text_for(i)))
    steps = scheduler.run(model, "cpu")

    def shape(h: Any) -> dict:
        r = h.result
        shaped = {"tokens": r.token_ids, "text": r.text, "finish_reason": r.finish_reason}
        return shaped if r.prompt_logprobs is None else {**shaped, "prompt_logprobs": r.prompt_logprobs}

    return {
        "steps": steps,
        "results": [shape(h) for h in handles],
        "late": [shape(h) for h in late_handles],
        "late_prompt_tokens": [len(h.request.prompt_ids) for h in late_handles],
        "largest_batch": scheduler.stats["largest_batch"],
    }


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden_size=72, num_heads=9, num_kv_heads=3)


@pytest.fixture(scope="module")
def moe_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_moe(tmp_path_factory.mktemp("moe") / "model", "qwen3_moe")


@pytest.fixture(scope="module", params=["gather", "reshard", "tp", "tp+ep"])
def batch_ranks(request: pytest.FixtureRequest, llama_path: Path, moe_path: Path, tmp_path_factory):
    path = moe_path if request.param == "tp+ep" else llama_path
    ranks = Ranks(
        path, tmp_path_factory.mktemp("ranks"), pg_timeout_s=60, layout=request.param, target=_batch_rank_main
    )
    yield ranks
    ranks.close()


def _run(ranks: Ranks, **kwargs: Any) -> dict:
    answers = ranks.run("batch", [kwargs] * WORLD_SIZE, deadline_s=240)
    assert answers[0]["steps"] == answers[1]["steps"]  # the follower ran every step rank 0 planned
    assert answers[0]["forwards"] == answers[1]["forwards"]  # with the same shapes
    return answers[0]


def _solo(ranks: Ranks, spec: dict) -> dict:
    return _run(ranks, requests=[spec])["results"][0]


def _specs() -> list[dict]:
    return [{"prompt": p, "max_new_tokens": 6 + 3 * i} for i, p in enumerate(PROMPTS)]


def test_eight_greedy_together_equal_alone(batch_ranks: Ranks) -> None:
    specs = _specs()
    specs[3]["stop"] = ["3"]  # a stop string (may or may not fire; it must fire alike)
    specs[5]["stop"] = ["Fran"]
    together = _run(batch_ranks, requests=specs)
    assert together["largest_batch"] == 8
    for spec, got in zip(specs, together["results"]):
        alone = _solo(batch_ranks, spec)
        assert got == alone, spec
        assert len(got["tokens"]) <= spec["max_new_tokens"]


def test_request_joins_mid_batch(batch_ranks: Ranks) -> None:
    specs = [{**spec, "max_new_tokens": 16, "ignore_eos": True} for spec in _specs()[:2]]
    joining = {"prompt": PROMPTS[6], "max_new_tokens": 12}
    answer = _run(batch_ranks, requests=specs, late=[{"after": (0, 1), "request": joining}])
    assert answer["largest_batch"] == 3
    assert answer["late"] == [_solo(batch_ranks, joining)]
    assert answer["results"] == [_solo(batch_ranks, s) for s in specs]


def test_prompts_joining_at_one_step_share_one_prefill_forward(batch_ranks: Ranks) -> None:
    """Three prompts of different lengths arriving together mid-batch are prefilled in one left-padded forward
    (one of them scoring its prompt, so every position's logits are kept), and each reply equals its solo one."""
    specs = [{"prompt": p, "max_new_tokens": 10, "ignore_eos": True} for p in PROMPTS[:2]]
    joining = [
        {"prompt": PROMPTS[2], "max_new_tokens": 8},
        {"prompt": PROMPTS[4], "max_new_tokens": 6, "prompt_logprobs": True, "logprobs": 0},
        {"prompt": PROMPTS[7], "max_new_tokens": 9},
    ]
    answer = _run(batch_ranks, requests=specs, late=[{"after": (0, 1), "request": r} for r in joining])
    prefills = [shape for shape in answer["forwards"] if shape[1] > 1]
    lengths = answer["late_prompt_tokens"]
    assert prefills[1:] == [(3, max(lengths))] and prefills[0][0] == 2, answer["forwards"]
    assert len(set(lengths)) == 3  # the joiners have different lengths, so their forward was padded
    assert answer["largest_batch"] == 5
    for got, spec in zip(answer["late"], joining):
        alone = _solo(batch_ranks, spec)
        assert {**got, "prompt_logprobs": None} == {**alone, "prompt_logprobs": None}, spec
        if spec.get("prompt_logprobs"):
            assert got["prompt_logprobs"][0] is None and alone["prompt_logprobs"][0] is None
            assert got["prompt_logprobs"][1:] == pytest.approx(alone["prompt_logprobs"][1:], abs=1e-4)
    assert answer["results"] == [_solo(batch_ranks, s) for s in specs]


def test_stopping_one_of_four_leaves_the_others(batch_ranks: Ranks) -> None:
    specs = [{"prompt": p, "max_new_tokens": 14, "ignore_eos": True} for p in PROMPTS[:4]]
    answer = _run(batch_ranks, requests=specs, stop_after={1: 1})
    assert answer["results"][1]["finish_reason"] == "interrupted"
    assert len(answer["results"][1]["tokens"]) < 14
    for i in (0, 2, 3):
        assert answer["results"][i] == _solo(batch_ranks, specs[i])


def test_seeded_sample_same_alone_and_in_a_batch(batch_ranks: Ranks) -> None:
    sampled = {"prompt": PROMPTS[0], "max_new_tokens": 12, "do_sample": True, "temperature": 1.5, "seed": 7}
    others = [{"prompt": p, "max_new_tokens": 10, "do_sample": True, "seed": 1} for p in PROMPTS[1:5]]
    together = _run(batch_ranks, requests=[*others[:2], sampled, *others[2:]])
    assert together["results"][2] == _solo(batch_ranks, sampled)
    other_seed = _solo(batch_ranks, {**sampled, "seed": 8})
    assert other_seed["tokens"] != together["results"][2]["tokens"]


def test_batch_limits(batch_ranks: Ranks) -> None:
    specs = [{"prompt": p, "max_new_tokens": 8} for p in PROMPTS[:5]]
    answer = _run(batch_ranks, requests=specs, limits={"max_sequences": 2, "max_step_tokens": 64})
    assert answer["largest_batch"] == 2
    assert answer["results"] == [_solo(batch_ranks, s) for s in specs]


def test_a_prompt_that_never_fits_is_refused_before_it_runs(llama_path: Path) -> None:
    from transformers import AutoTokenizer

    from shardbook.rankd.generation.batching import BatchLimitError, BatchScheduler, SequenceRequest

    tokenizer = AutoTokenizer.from_pretrained(llama_path)
    scheduler = BatchScheduler(tokenizer, context=256)
    with pytest.raises(BatchLimitError, match="context"):
        scheduler.submit(SequenceRequest(prompt_ids=[1] * 200, max_new_tokens=100))
    assert scheduler.waiting == []  # a prompt longer than a step is prefilled in chunks: test_chunked_prefill.py
