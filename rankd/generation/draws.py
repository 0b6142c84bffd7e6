"""One draw for every sampled row of a step at once: top-k, top-p, then each row's own generator.

Drawn row by row (a top-k, a sort of the whole vocabulary for top-p, a softmax and a multinomial per
row), 32 sampled rows of the demo model's 49,152-token vocabulary at top-p 0.9 took 177 ms a step on one
core, longer than its 32-row forward under `tp` (about 145 ms); together they take 16 ms
(`bench/bench_sampling.py`). Here the rows share each operation, and top-k or top-p rows never sort the whole
vocabulary: their candidates are the best `CANDIDATES` tokens (or the largest top-k asked), and only a row
whose candidates hold less probability than its `top_p` (a flat distribution) is sorted in full.

The draw is an inverse CDF: one uniform number from the row's own `torch.Generator` (so a seeded row
draws the same tokens alone and in any batch), scaled to the row's kept mass and looked up in its
cumulative weights. A token of zero weight is never drawn.

The filters are transformers' (top-k, then top-p over the top-k's renormalised probabilities, keeping a
token while the mass of the better tokens before it is under `top_p`, and always the best), with one
difference at exact ties: top-k keeps exactly k tokens, where transformers keeps every token equal to the
k-th.
"""

from __future__ import annotations

import torch

CANDIDATES = 256
"""Tokens a top-p row without top-k looks at before it falls back to sorting its whole vocabulary."""


def draw_rows(
    scores: torch.Tensor, top_k: list[int], top_p: list[float], generators: list[torch.Generator | None]
) -> list[int]:
    """A token for each row of `scores` (rows of finite best scores, already penalised and divided by their
    temperature), filtered by the row's `top_k` (0: none) and `top_p` (1.0: none)."""
    uniforms = torch.stack([torch.rand((), generator=g) for g in generators]).to(scores.device)
    tokens = torch.empty(len(generators), dtype=torch.long, device=scores.device)
    narrow = [i for i in range(len(generators)) if top_k[i] > 0 or top_p[i] < 1.0]
    whole = sorted(set(range(len(generators))) - set(narrow))
    if whole:
        probs = torch.softmax(take_rows(scores, whole), dim=-1, dtype=torch.float32)
        tokens[whole] = _inverse_cdf(probs, uniforms[whole])
    if narrow:
        tokens[narrow] = _draw_filtered(take_rows(scores, narrow), top_k, top_p, narrow, uniforms[narrow])
    return tokens.tolist()


def take_rows(tensor: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """`tensor[rows]`, without the copy when `rows` is every row in order (a step's logits are megabytes)."""
    return tensor if rows == list(range(tensor.shape[0])) else tensor[rows]


def _draw_filtered(
    scores: torch.Tensor, top_k: list[int], top_p: list[float], rows: list[int], uniforms: torch.Tensor
) -> torch.Tensor:
    """Draws for top-k or top-p rows from their best candidates; rows whose candidates fall short of their
    `top_p` are drawn again over the whole vocabulary."""
    vocab = scores.shape[-1]
    ks = [top_k[i] for i in rows]
    ps = torch.tensor([top_p[i] for i in rows], device=scores.device)
    width = min(vocab, max(k if k > 0 else CANDIDATES for k in ks))
    weights, candidates, falls_short = _filtered_weights(scores, ks, ps, width)
    tokens = candidates.gather(1, _inverse_cdf(weights, uniforms).unsqueeze(1)).squeeze(1)
    short = [j for j in range(len(rows)) if falls_short[j] and width < vocab]
    if short:
        weights, candidates, _ = _filtered_weights(scores[short], [ks[j] for j in short], ps[short], vocab)
        tokens[short] = candidates.gather(1, _inverse_cdf(weights, uniforms[short]).unsqueeze(1)).squeeze(1)
    return tokens


def _filtered_weights(
    scores: torch.Tensor, ks: list[int], ps: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor, list[bool]]:
    """(each row's kept probabilities over its best `width` tokens, those tokens' ids, whether a row without
    top-k may keep tokens beyond them)."""
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
    if width < scores.shape[-1]:
        candidates = torch.topk(scores, width, dim=-1).indices
    else:  # a whole sort, a little cheaper than a top-k of every token
        candidates = torch.sort(scores, dim=-1, descending=True).indices
    best = probs.gather(1, candidates)
    limits = torch.tensor([k if k > 0 else width for k in ks], device=scores.device)
    best = best.masked_fill(torch.arange(width, device=scores.device) >= limits.unsqueeze(1), 0.0)
    has_k = torch.tensor([k > 0 for k in ks], device=scores.device)
    share = torch.where(has_k.unsqueeze(1), best / best.sum(dim=-1, keepdim=True), best)
    before = share.cumsum(dim=-1) - share
    keep = before < ps.unsqueeze(1)
    keep[:, 0] = True
    short = (~has_k & (share.sum(dim=-1) < ps)).tolist()
    return share * keep, candidates, short


def _inverse_cdf(weights: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The position each row's uniform number falls at in its cumulative `weights` (unnormalised): the first
    whose running sum exceeds it, so a zero weight is never picked."""
    running = weights.cumsum(dim=-1)
    target = (uniforms * running[:, -1]).unsqueeze(1)
    return torch.searchsorted(running, target, right=True).squeeze(1).clamp(max=weights.shape[-1] - 1)
