"""One sequence's next token from its logits, and the bounds a sampling setting must keep to stay a number.

The continuous batch (`batching.py`) picks each row's token here (every plain greedy row at once,
`greedy_tokens`): the repetition penalty, the ban on
end-of-text before `min_tokens`, then greedy or temperature, top-k, top-p and one draw from the request's
own generator (transformers' order). A row whose scores are no longer numbers (not-a-number, +inf, or
nothing left to pick) raises :class:`NonFiniteScores`, which fails that sequence only.

The bounds are where the float32 arithmetic stops being numbers for real logits: dividing logits by a
temperature under `MIN_TEMPERATURE`, or by a penalty under `MIN_REPETITION_PENALTY`, overflows to inf long
before it changes which token wins (below them sampling is greedy in all but name), and a penalty over
`MAX_REPETITION_PENALTY` pushes every seen token to -inf. Every request is checked against them, in the
batch's `SequenceRequest` and the single path's `GenerationRequest` alike.
"""

from __future__ import annotations

import math
from typing import Any

import torch

MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature; 0 (``do_sample=False``) is greedy."""
MIN_REPETITION_PENALTY = 1e-2
MAX_REPETITION_PENALTY = 1e2


class NonFiniteScores(ValueError):
    """A row's scores hold not-a-number or +inf, or forbid every token: its sequence cannot go on."""


def check_sampling(do_sample: bool, temperature: float, repetition_penalty: float, fix_greedy: str) -> str | None:
    """What is wrong with these settings (the message names the fix), or None; `fix_greedy` says how to ask for
    greedy decoding where the caller is. The temperature only counts when sampling."""
    if do_sample and not (math.isfinite(temperature) and temperature >= MIN_TEMPERATURE):
        return (
            f"temperature must be a number >= {MIN_TEMPERATURE:g}, got {temperature}: below it the scaled logits "
            f"overflow; {fix_greedy} for greedy decoding"
        )
    if not MIN_REPETITION_PENALTY <= repetition_penalty <= MAX_REPETITION_PENALTY:
        return (
            f"repetition_penalty must be in [{MIN_REPETITION_PENALTY:g}, {MAX_REPETITION_PENALTY:g}] (1.0 is none), "
            f"got {repetition_penalty}: outside it the penalized logits overflow"
        )
    return None


def next_token(logits: torch.Tensor, request: Any, generated: list[int], generator: torch.Generator | None) -> int:
    """The next token of the sequence `request` describes, which has generated `generated` so far."""
    scores = logits.clone()
    if request.repetition_penalty != 1.0:
        seen = torch.tensor(list(request.prompt_ids) + generated)
        picked = scores[seen]
        scores[seen] = torch.where(picked < 0, picked * request.repetition_penalty, picked / request.repetition_penalty)
    if not request.ignore_eos and len(generated) < request.min_tokens and request.eos_ids:
        scores[torch.tensor(request.eos_ids)] = float("-inf")
    if request.do_sample:
        scores = scores / request.temperature
    _check_finite(scores)
    if not request.do_sample:
        return int(torch.argmax(scores))
    return _draw(scores, request, generator)


def greedy_tokens(logits: torch.Tensor, requests: list[Any], generated: list[int]) -> list[int | None]:
    """Each plain greedy row's next token from one argmax over the batch's logits (`logits`, a row per request;
    `generated`, how many tokens each has made): one host sync for every row instead of a copy and two syncs per
    row. None for a row `next_token` must pick: sampling, a repetition penalty, `min_tokens` still banning the
    end, or scores that are not numbers (which `next_token` reports). The same token `next_token` picks."""
    best, index = logits.max(dim=-1)  # the first of equal maxima, as argmax
    picks = torch.where(torch.isfinite(best), index, -1).tolist()
    return [
        token if token >= 0 and _plain_greedy(request, count) else None
        for token, request, count in zip(picks, requests, generated)
    ]


def _plain_greedy(request: Any, generated: int) -> bool:
    holds_eos = not request.ignore_eos and generated < request.min_tokens and request.eos_ids
    return not request.do_sample and request.repetition_penalty == 1.0 and not holds_eos


def _check_finite(scores: torch.Tensor) -> None:
    """Raise NonFiniteScores unless the best score is a number (max propagates not-a-number; +inf and an all
    -inf row are not numbers either). Top-k and top-p keep the best token, so this holds through them."""
    best = float(scores.max())
    if not math.isfinite(best):
        why = "not-a-number" if math.isnan(best) else "+inf" if best > 0 else "no token left to pick"
        raise NonFiniteScores(f"the next-token scores are not numbers ({why}): this sequence cannot go on")


def _draw(scores: torch.Tensor, request: Any, generator: torch.Generator | None) -> int:
    """Top-k, top-p (in transformers' order), then one draw from this request's own generator."""
    if request.top_k:
        kth = torch.topk(scores, min(request.top_k, scores.numel())).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if request.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        remove = cumulative <= (1 - request.top_p)
        remove[-1] = False
        scores = scores.masked_fill(remove.scatter(0, order, remove), float("-inf"))
    probs = torch.softmax(scores, dim=-1).cpu()
    return int(torch.multinomial(probs, 1, generator=generator))
