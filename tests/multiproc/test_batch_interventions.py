"""Interventions in the continuous batch, on two gloo ranks under `tp`: a cell's rows are intervened, a client's not.

One batch holds a notebook cell's request (`intervene`, as `kernel/api/batch.submit` marks a cell's rows while
`%intervene` functions are set) and an HTTP client's, prefilled together in one left-padded forward. The cell's
reply must equal the single-reply path's intervened reply (tokens, and each token's probability within float
rounding), its function must see the shapes it sees there ([1, prompt, features], then [1, 1, features]), and the
client's reply must equal its solo reply with no intervention at all.
"""

from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_engine import SCENARIOS, WORLD_SIZE, Ranks, _rank_main
from tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)

MODULE = "model.layers.1.mlp"
CELL = [{"role": "user", "content": "What is the capital of France?"}]
CLIENT = [{"role": "user", "content": "Tell me a long story about sharded models, please"}]
NEW_TOKENS = 8


def _steer(seen: list[tuple[int, ...]]):
    def steer(output: torch.Tensor, module_name: str) -> torch.Tensor:
        seen.append(tuple(output.shape))
        return output * 4 + 1

    return steer


def scenario_single(model: Any, tokenizer: Any, rank: int, intervene: bool = True) -> dict:
    """The cell's reply on the single-reply path (the engine's generate), the function registered: on every row,
    or (not `intervene`: an HTTP client's reply there) on none."""
    from shardbook.rankd.generation.engine import GenerationRequest, generate
    from shardbook.rankd.inspection import interventions

    seen: list[tuple[int, ...]] = []
    interventions.add(model, {"steer": _steer(seen)}, "steer", [MODULE], on_input=False)
    try:
        request = GenerationRequest(
            messages=CELL, max_new_tokens=NEW_TOKENS, want_scores=True, seed=0, intervene=intervene
        )
        result = generate(model, tokenizer, request, device="cpu", on_text=None, stop_event=threading.Event())
        interventions.raise_failures(model)
    finally:
        interventions.remove(model, None)
    if rank != 0:
        return {"seen": seen}
    return {"seen": seen, "tokens": [s.token_id for s in result.scores], "probs": [s.prob for s in result.scores]}


def scenario_batch(
    model: Any, tokenizer: Any, rank: int, rows: list[str], intervention: bool, max_step_tokens: int = 2048
) -> dict:
    """`rows` ("cell", "client") decoded in one batch, with the function registered when `intervention`."""
    from shardbook.rankd.generation.batching import BatchScheduler, SequenceRequest, follow_batch
    from shardbook.rankd.generation.engine import build_prompt_ids
    from shardbook.rankd.inspection import interventions

    seen: list[tuple[int, ...]] = []
    if intervention:
        interventions.add(model, {"steer": _steer(seen)}, "steer", [MODULE], on_input=False)
    try:
        if rank != 0:
            follow_batch(model, "cpu")
            return {"seen": seen}
        scheduler = BatchScheduler(tokenizer, max_step_tokens=max_step_tokens)
        eos = [model.generation_config.eos_token_id, tokenizer.eos_token_id]
        handles = []
        for row in rows:
            ids = build_prompt_ids(tokenizer, CELL if row == "cell" else CLIENT)[0].tolist()
            request = SequenceRequest(
                ids, max_new_tokens=NEW_TOKENS, eos_ids=[e for e in eos if e is not None], logprobs=0
            )
            handles.append(scheduler.submit(SequenceRequest(**{**vars(request), "intervene": row == "cell"})))
        scheduler.run(model, "cpu")
    finally:
        interventions.remove(model, None)
    results = [h.result for h in handles]
    assert all(r.finish_reason in ("stop", "length") for r in results), [r.error for r in results]
    return {
        "seen": seen,
        "largest_batch": scheduler.stats["largest_batch"],
        "replies": {row: (r.token_ids, torch.tensor(r.token_logprobs).exp().tolist()) for row, r in zip(rows, results)},
    }


def _intervention_rank_main(*args: Any) -> None:
    """test_engine's rank, with this module's scenarios."""
    SCENARIOS.update(single=scenario_single, batch=scenario_batch)
    _rank_main(*args)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", hidden_size=72, num_heads=9, num_kv_heads=3)
    ranks = Ranks(path, tmp_path_factory.mktemp("ranks"), pg_timeout_s=60, layout="tp", target=_intervention_rank_main)
    yield ranks
    ranks.close()


def _run(ranks: Ranks, scenario: str, **kwargs: Any) -> list[dict]:
    return ranks.run(scenario, [kwargs] * WORLD_SIZE, deadline_s=240)


def test_an_intervention_applies_to_the_cells_rows_only(ranks: Ranks) -> None:
    single = _run(ranks, "single")
    together = _run(ranks, "batch", rows=["client", "cell"], intervention=True)
    client_alone = _run(ranks, "batch", rows=["client"], intervention=False)[0]["replies"]["client"]
    cell_untouched = _run(ranks, "batch", rows=["cell"], intervention=False)[0]["replies"]["cell"]

    assert together[0]["largest_batch"] == 2  # both rows shared the batch, and its prefill forward
    tokens, probs = together[0]["replies"]["cell"]
    _assert_same((tokens, probs), (single[0]["tokens"], single[0]["probs"]))
    assert probs != cell_untouched[1]  # the function changed the cell's reply
    for rank in range(WORLD_SIZE):  # on every rank, the function saw what the single path shows it: its row only
        assert together[rank]["seen"] == single[rank]["seen"], rank
    hidden = single[0]["seen"][0][-1]
    assert single[0]["seen"][0][0] == 1 and single[0]["seen"][1:] == [(1, 1, hidden)] * (len(tokens) - 1)

    _assert_same(together[0]["replies"]["client"], client_alone)  # untouched by the cell's function

    # a client's reply on the single-reply path is untouched too
    client_single = _run(ranks, "single", intervene=False)
    _assert_same((client_single[0]["tokens"], client_single[0]["probs"]), cell_untouched)
    assert client_single[0]["seen"] == client_single[1]["seen"] == []

    # both prompts prefilled in chunks of at most 20 tokens (the client's first), the cell's intervened alone
    chunked = _run(ranks, "batch", rows=["client", "cell"], intervention=True, max_step_tokens=20)[0]["replies"]
    _assert_same(chunked["cell"], (single[0]["tokens"], single[0]["probs"]))
    _assert_same(chunked["client"], client_alone)


def _assert_same(got: tuple[list[int], list[float]], want: tuple[list[int], list[float]]) -> None:
    assert got[0] == want[0]
    torch.testing.assert_close(torch.tensor(got[1]), torch.tensor(want[1]), rtol=1e-4, atol=1e-5)
