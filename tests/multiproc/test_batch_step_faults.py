"""A batch step that raises, on every rank or on one, on two gloo ranks: every rank agrees on how the step ended,
only the rows it must fail, and the batch goes on (no rank leaves its loop, none waits for a timeout).

Each rank holds the whole tiny llama (no collectives inside a forward), and a forward hook raises on a
condition: a prefill holding the poisoned prompt's marker token, or a follower's third decode forward.
The process group keeps its 30-minute default timeout: a rank left in a broadcast would show as a hang,
which the harness's deadline turns into a failure naming the rank.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)

HEALTHY = ["What is the capital of France?", "Hello", "Numbers: 0 1 2"]
POISONED = "def add(a, b):"


class Poisoned(RuntimeError):
    pass


def _faulty_ranks(rank: int, path: Path, fault: str) -> dict[str, Any]:
    """`fault` is "prefill everywhere", "prefill on rank 1" or "decode on rank 1"."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(path)
    marker = tokenizer(POISONED)["input_ids"][-1]
    assert all(marker not in tokenizer(p)["input_ids"] for p in HEALTHY)

    def request(prompt: str) -> SequenceRequest:
        return SequenceRequest(prompt_ids=tokenizer(prompt)["input_ids"], max_new_tokens=8, ignore_eos=True)

    def batch(prompts: list[str], late: str | None = None, **limits) -> list[Any] | int:
        """Rank 0 runs the batch (`late` joins at the first decode step); a follower follows. The results, or the
        follower's steps."""
        if rank != 0:
            return follow_batch(model, "cpu")
        scheduler = BatchScheduler(tokenizer, **limits)
        handles = [scheduler.submit(request(p)) for p in prompts]

        def join_late(_module, _args, kwargs) -> None:
            if late is not None and kwargs["input_ids"].shape[1] == 1 and len(handles) == len(prompts):
                handles.append(scheduler.submit(request(late)))

        hook = model.register_forward_pre_hook(join_late, with_kwargs=True)
        try:
            scheduler.run(model, "cpu")
        finally:
            hook.remove()
        return [(h.result.finish_reason, h.result.token_ids, h.result.error) for h in handles]

    clean = batch(HEALTHY)
    decodes = []

    def raise_on_condition(_module, _args, kwargs) -> None:
        ids = kwargs["input_ids"]
        if ids.shape[1] == 1:
            decodes.append(1)
        if fault.startswith("prefill") and (fault == "prefill everywhere" or rank == 1):
            if ids.shape[1] > 1 and bool((ids == marker).any()):
                raise Poisoned("the poisoned prompt is refused")
        if fault == "decode on rank 1" and rank == 1 and ids.shape[1] == 1 and len(decodes) == 3:
            raise Poisoned("rank 1's third decode forward failed")

    hook = model.register_forward_pre_hook(raise_on_condition, with_kwargs=True)
    try:
        if fault == "decode on rank 1":  # two rows decode, the third request waits for a row
            faulty = batch(HEALTHY, max_sequences=2)
        else:
            faulty = batch(HEALTHY, late=POISONED)
        after = batch(HEALTHY[:2])  # the next requests, with the hook still there
    finally:
        hook.remove()
    return {"clean": clean, "faulty": faulty, "after": after}


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")


def _lengths_as_clean(results: list, clean: list) -> bool:
    return [(r[0], r[1]) for r in results] == [(c[0], c[1]) for c in clean] and all(r[0] == "length" for r in results)


@pytest.mark.parametrize("fault", ["prefill everywhere", "prefill on rank 1"])
def test_a_prefill_that_raises_fails_only_the_joining_prompt(ranks, llama_path: Path, fault: str) -> None:
    leader, follower = ranks(_faulty_ranks, llama_path, fault)
    poisoned = leader["faulty"][3]
    failed = "rank(s) 0, 1" if fault == "prefill everywhere" else "rank(s) 1"  # alike failures shown once
    assert poisoned[0] == "error" and f"{failed}: Poisoned: the poisoned prompt is refused" in poisoned[2], poisoned
    assert _lengths_as_clean(leader["faulty"][:3], leader["clean"])  # the running rows went on, unchanged
    assert _lengths_as_clean(leader["after"], leader["clean"][:2])
    assert isinstance(follower["faulty"], int) and follower["faulty"] > 0  # the follower stayed in its loop


def test_a_decode_that_raises_on_one_rank_fails_its_rows_and_the_waiting_request_runs(ranks, llama_path: Path) -> None:
    leader, follower = ranks(_faulty_ranks, llama_path, "decode on rank 1")
    first_two, waiting = leader["faulty"][:2], leader["faulty"][2]
    assert [r[0] for r in first_two] == ["error", "error"], first_two
    assert all("rank(s) 1: Poisoned: rank 1's third decode forward failed" in r[2] for r in first_two), first_two
    assert _lengths_as_clean([waiting], leader["clean"][2:])  # it started after the failure, in the same loop
    assert _lengths_as_clean(leader["after"], leader["clean"][:2])
    assert isinstance(follower["after"], int) and follower["after"] > 0
