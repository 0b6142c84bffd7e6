"""The step's sampled tokens, drawn for every row at once (`draws.draw_rows`, `sampling.pick_tokens`): each row
follows the distribution transformers' own warpers leave (temperature, top-k, top-p), never draws a token they
remove, draws alike alone and in any batch, and fails alone when its scores are not numbers.

The draws are seeded, so every figure here is the same on every run; the tolerances are for sampling error."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from shardbook.rankd.generation.draws import CANDIDATES, draw_rows
from shardbook.rankd.generation.sampling import NonFiniteScores, pick_tokens
from shardbook.rankd.generation.sequences import SequenceRequest

ROWS = 20000


def _transformers_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """The probabilities transformers samples from after its warpers, in its order."""
    scores = TemperatureLogitsWarper(temperature)(None, logits.unsqueeze(0).clone())
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores, dim=-1).squeeze(0)


def _frequencies(logits: torch.Tensor, temperature: float, top_k: int, top_p: float, rows: int = ROWS) -> torch.Tensor:
    """How often each token comes out of `rows` seeded draws of one row's scores, each its own generator."""
    scores = (logits / temperature).expand(rows, -1)
    generators = [torch.Generator().manual_seed(seed) for seed in range(rows)]
    tokens = draw_rows(scores, [top_k] * rows, [top_p] * rows, generators)
    return torch.bincount(torch.tensor(tokens), minlength=logits.numel()).double() / rows


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, 0, 1.0), (0.5, 0, 1.0), (1.0, 5, 1.0), (1.0, 0, 0.8), (0.7, 10, 0.7), (2.0, 3, 0.95)],
)
def test_draws_follow_the_distribution_transformers_warpers_leave(temperature: float, top_k: int, top_p: float) -> None:
    logits = torch.randn(40, generator=torch.Generator().manual_seed(3)) * 2
    expected = _transformers_probs(logits, temperature, top_k, top_p).double()
    seen = _frequencies(logits, temperature, top_k, top_p)
    assert torch.all(seen[expected == 0] == 0), "drew a token the warpers remove"
    assert (seen - expected).abs().sum() / 2 < 0.03  # total variation; torch.multinomial's here is 0.007-0.014


def test_a_flat_row_keeps_its_top_p_tokens_beyond_the_candidates() -> None:
    """A near-uniform row needs about half its 2000 tokens for top-p 0.5: more than the candidates looked at first,
    so it is drawn again over the whole vocabulary, and still never outside what transformers keeps."""
    logits = torch.randn(2000, generator=torch.Generator().manual_seed(4)) * 0.01
    kept = _transformers_probs(logits, 1.0, 0, 0.5) > 0
    assert CANDIDATES < int(kept.sum()) < 2000
    seen = _frequencies(logits, 1.0, 0, 0.5, rows=2000) > 0
    assert not torch.any(seen & ~kept)
    beyond = torch.ones(2000, dtype=torch.bool)
    beyond[torch.topk(logits, CANDIDATES).indices] = False
    assert torch.any(seen & beyond)


def test_a_seeded_row_draws_alike_alone_and_in_any_batch() -> None:
    settings = [(0, 1.0), (5, 1.0), (0, 0.9), (20, 0.6), (0, 1.0), (3, 0.99)]
    logits = torch.randn(len(settings), 500, generator=torch.Generator().manual_seed(5)) * 3
    top_k, top_p = [k for k, _ in settings], [p for _, p in settings]

    def generators() -> list[torch.Generator]:
        return [torch.Generator().manual_seed(100 + i) for i in range(len(settings))]

    batch_generators = generators()
    together = [draw_rows(logits, top_k, top_p, batch_generators) for _ in range(8)]
    for row, generator in enumerate(generators()):
        alone = [draw_rows(logits[row : row + 1], top_k[row : row + 1], top_p[row : row + 1], [generator])[0]]
        alone += [draw_rows(logits[row : row + 1], [top_k[row]], [top_p[row]], [generator])[0] for _ in range(7)]
        assert alone == [step[row] for step in together]


def test_pick_tokens_penalises_bans_the_end_and_fails_a_row_alone() -> None:
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(6))
    logits[1, 9] = 50.0  # the end token, best by far
    logits[3, 2] = float("nan")
    prompt = [1, 4, 7]
    requests = [
        SequenceRequest(prompt_ids=prompt, repetition_penalty=3.0),
        SequenceRequest(prompt_ids=prompt, min_tokens=5, eos_ids=[9]),
        SequenceRequest(prompt_ids=prompt, do_sample=True, temperature=0.8, top_k=4, repetition_penalty=1.5),
        SequenceRequest(prompt_ids=prompt, do_sample=True),
    ]
    generated = [[int(logits[0].argmax())], [], [], []]
    generators = [None, None, torch.Generator().manual_seed(1), torch.Generator().manual_seed(2)]
    picks = pick_tokens(logits, requests, generated, generators)
    penalised = RepetitionPenaltyLogitsProcessor(3.0)(torch.tensor([prompt + generated[0]]), logits[:1].clone())
    assert picks[0] == int(penalised.argmax())
    assert picks[1] == int(logits[1, :9].argmax())
    shaped = RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([prompt]), logits[2:3].clone())
    assert picks[2] in torch.topk(shaped[0] / 0.8, 4).indices.tolist()
    assert isinstance(picks[3], NonFiniteScores) and "not-a-number" in str(picks[3])
