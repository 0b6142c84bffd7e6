"""`sampling.greedy_tokens`: the batch's one argmax for its plain greedy rows picks what `next_token` picks row by
row, and leaves to `next_token` every row that needs it."""

from __future__ import annotations

import pytest
import torch

from shardbook.rankd.generation.sampling import NonFiniteScores, greedy_tokens, next_token
from shardbook.rankd.generation.sequences import SequenceRequest


def test_plain_greedy_rows_match_next_token_and_the_others_are_left_to_it() -> None:
    logits = torch.randn(6, 50, generator=torch.Generator().manual_seed(0))
    logits[1, 7] = logits[1, 9] = logits[1].max() + 1  # a tie: the first, as argmax
    logits[5, 3] = float("nan")
    plain = SequenceRequest(prompt_ids=[1, 2])
    requests = [
        plain,
        plain,
        SequenceRequest(prompt_ids=[1, 2], do_sample=True),
        SequenceRequest(prompt_ids=[1, 2], repetition_penalty=1.3),
        SequenceRequest(prompt_ids=[1, 2], min_tokens=4, eos_ids=[int(logits[4].argmax())]),
        plain,
    ]
    picked = greedy_tokens(logits, requests, [0, 0, 0, 0, 1, 0])
    assert picked[:2] == [next_token(logits[i], plain, [], None) for i in range(2)] and picked[1] == 7
    assert picked[2:] == [None] * 4  # sampling, a penalty, min_tokens holding back the end, not a number
    with pytest.raises(NonFiniteScores):
        next_token(logits[5], plain, [], None)
    assert greedy_tokens(logits[4:5], requests[4:5], [4]) == [int(logits[4].argmax())]  # min_tokens reached


def test_suppressed_tokens_are_never_picked_greedy_or_sampled() -> None:
    """A checkpoint's `generation_config.suppress_tokens` (the test talker suppresses its end of text) hold in the
    batch as in transformers' generate: a greedy row takes the best other token, a sampled row never draws one."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(1))
    best = int(logits[0].argmax())
    logits[0, best] = 30.0  # all but certain to be drawn at any temperature
    greedy = SequenceRequest(prompt_ids=[1], suppress_ids=[best])
    assert greedy_tokens(logits, [greedy], [0]) == [None]  # left to next_token
    without = logits[0].clone()
    without[best] = float("-inf")
    assert next_token(logits[0], greedy, [], None) == int(without.argmax())
    sampled = SequenceRequest(prompt_ids=[1], do_sample=True, temperature=2.0, suppress_ids=[best])
    draws = [next_token(logits[0], sampled, [], torch.Generator().manual_seed(seed)) for seed in range(50)]
    assert best not in draws
    unsuppressed = SequenceRequest(prompt_ids=[1], do_sample=True, temperature=2.0)
    assert next_token(logits[0], unsuppressed, [], torch.Generator().manual_seed(0)) == best
