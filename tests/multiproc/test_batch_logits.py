"""Under `tp` the batch's logits reach rank 0 alone: a step gathers the vocabulary-parallel output layer's columns on
rank 0 (where every row is sampled) and a follower's output layer keeps its own columns, while the same forward
outside the batch (and a batch step that runs an intervention) still gives every rank the whole vocabulary.

Two gloo ranks, a tiny llama whose vocabulary splits between them; a forward hook on `lm_head` records the width of
each forward's output on each rank."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)


def _widths(rank: int, path: Path) -> dict[str, Any]:
    import torch

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode="tp")
    )
    loaded = load_sharded(config, device="cpu")
    model = loaded.model
    widths: list[int] = []
    hook = model.lm_head.register_forward_hook(lambda _m, _a, out: widths.append(out.shape[-1]))
    prompt = loaded.tokenizer("The capital of France is")["input_ids"]
    with torch.no_grad():
        whole = model(torch.tensor([prompt])).logits[0, -1]
        outside = list(widths)
        widths.clear()
        if rank == 0:
            scheduler = BatchScheduler(loaded.tokenizer)
            handle = scheduler.submit(SequenceRequest(prompt_ids=prompt, max_new_tokens=3, ignore_eos=True))
            scheduler.run(model, "cpu")
            first = handle.wait(0).token_ids[0]
        else:
            follow_batch(model, "cpu")
            first = None
    hook.remove()
    return {"vocab": model.config.vocab_size, "outside": outside, "batch": widths, "first": first, "whole": whole}


@pytest.fixture(scope="module")
def widths(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    from tests.ranks import run_ranks

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model")
    return run_ranks(_widths, path, deadline=180)


def test_outside_the_batch_every_rank_gets_the_whole_vocabulary(widths: list[dict[str, Any]]) -> None:
    assert [w["outside"] for w in widths] == [[w["vocab"]] for w in widths]


def test_in_the_batch_rank_0_gets_the_whole_vocabulary_and_a_follower_its_own_columns(
    widths: list[dict[str, Any]],
) -> None:
    leader, follower = widths
    vocab = leader["vocab"]
    assert leader["batch"] == [vocab] * 3  # the prefill, then two decode steps (the third token is never fed)
    assert len(follower["batch"]) == 3 and all(0 < width < vocab for width in follower["batch"])
    assert leader["first"] == int(leader["whole"].argmax())  # the gathered logits are the whole ones, in order
