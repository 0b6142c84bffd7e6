"""One sequence's next token from its logits, and the bounds a sampling setting must keep to stay a number.

The continuous batch (`batching.py`) picks every row's token of a step here at once (`pick_tokens`):
plain greedy rows from one argmax; the others get the repetition penalty, the ban on end-of-text before
`min_tokens`, then greedy or temperature, top-k, top-p and one draw from the request's own generator
(transformers' order; the draws are `draws.py`'s, every sampled row together). A row whose scores are no
longer numbers (not-a-number, +inf, or nothing left to pick) gets :class:`NonFiniteScores` instead of a
token, which fails that sequence only.

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

from shardbook.rankd.generation.draws import draw_rows, take_rows

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


def pick_tokens(
    logits: torch.Tensor, requests: list[Any], generated: list[list[int]], generators: list[torch.Generator | None]
) -> list[int | NonFiniteScores]:
    """Each row's next token (`logits`, a row per request; `generated`, the tokens each has made; `generators`,
    each sampled request's own), or the NonFiniteScores that fails that row alone."""
    picks: list[int | NonFiniteScores | None] = list(greedy_tokens(logits, requests, [len(g) for g in generated]))
    rest = [i for i, token in enumerate(picks) if token is None]
    if rest:
        shaped = _shaped_picks(
            take_rows(logits, rest),
            [requests[i] for i in rest],
            [generated[i] for i in rest],
            [generators[i] for i in rest],
        )
        for i, pick in zip(rest, shaped):
            picks[i] = pick
    return picks  # type: ignore[return-value]


def next_token(logits: torch.Tensor, request: Any, generated: list[int], generator: torch.Generator | None) -> int:
    """The next token of the sequence `request` describes, which has generated `generated` so far; raises
    NonFiniteScores when its scores are not numbers."""
    pick = pick_tokens(logits.unsqueeze(0), [request], [generated], [generator])[0]
    if isinstance(pick, NonFiniteScores):
        raise pick
    return pick


def greedy_tokens(logits: torch.Tensor, requests: list[Any], generated: list[int]) -> list[int | None]:
    """Each plain greedy row's next token from one argmax over the batch's logits (`logits`, a row per request;
    `generated`, how many tokens each has made): one host sync for every row instead of a copy and two syncs per
    row. None for a row that needs more: sampling, a repetition penalty, `min_tokens` still banning the end, or
    scores that are not numbers."""
    best, index = logits.max(dim=-1)  # the first of equal maxima, as argmax
    picks = torch.where(torch.isfinite(best), index, -1).tolist()
    return [
        token if token >= 0 and _plain_greedy(request, count) else None
        for token, request, count in zip(picks, requests, generated)
    ]


def _plain_greedy(request: Any, generated: int) -> bool:
    plain = not request.do_sample and request.repetition_penalty == 1.0
    return plain and not request.suppress_ids and not _holds_eos(request, generated)


def _holds_eos(request: Any, generated: int) -> bool:
    return bool(not request.ignore_eos and generated < request.min_tokens and request.eos_ids)


def _shaped_picks(
    logits: torch.Tensor, requests: list[Any], generated: list[list[int]], generators: list[torch.Generator | None]
) -> list[int | NonFiniteScores]:
    """Tokens for rows that are not plain greedy: divided by their temperature, penalised, suppressed tokens and
    end-of-text (before `min_tokens`) banned
    (transformers penalises before it divides; the two commute), then greedy rows by argmax and sampled rows
    drawn together."""
    temperatures = [request.temperature if request.do_sample else 1.0 for request in requests]
    scores = logits / torch.tensor(temperatures, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    for row, (request, made) in enumerate(zip(requests, generated)):  # both commute with the division
        if request.repetition_penalty != 1.0:
            _penalize(scores[row], list(request.prompt_ids) + made, request.repetition_penalty)
        banned = list(request.suppress_ids) + (list(request.eos_ids) if _holds_eos(request, len(made)) else [])
        if banned:
            scores[row, torch.tensor(banned, device=scores.device)] = float("-inf")
    best, index = scores.max(dim=-1)
    picks: list[int | NonFiniteScores] = [
        _not_numbers(score) or token for score, token in zip(best.tolist(), index.tolist())
    ]
    sampled = [i for i, r in enumerate(requests) if r.do_sample and not isinstance(picks[i], NonFiniteScores)]
    if sampled:
        drawn = draw_rows(
            take_rows(scores, sampled),
            [requests[i].top_k for i in sampled],
            [requests[i].top_p for i in sampled],
            [generators[i] for i in sampled],
        )
        for i, token in zip(sampled, drawn):
            picks[i] = token
    return picks


def _penalize(scores: torch.Tensor, seen_ids: list[int], penalty: float) -> None:
    """transformers' repetition penalty on one row, in place: a seen token's score is divided by `penalty`
    (multiplied when negative)."""
    seen = torch.tensor(seen_ids, device=scores.device)
    picked = scores[seen]
    scores[seen] = torch.where(picked < 0, picked * penalty, picked / penalty)


def _not_numbers(best: float) -> NonFiniteScores | None:
    """The error for a row whose best score is `best`, or None when it is a number (max propagates
    not-a-number; +inf and an all -inf row are not numbers either). Top-k and top-p keep the best token, so this
    holds through them."""
    if math.isfinite(best):
        return None
    why = "not-a-number" if math.isnan(best) else "+inf" if best > 0 else "no token left to pick"
    return NonFiniteScores(f"the next-token scores are not numbers ({why}): this sequence cannot go on")
