"""The batch's decode step attends over MLA's cached latents directly, without expanding them into keys and values.

Multi-head latent attention (DeepSeek-V3/V3.2, Kimi-K2, GLM-5) caches one latent per position (`kv_lora_rank`
values, plus a shared rotary key) and transformers' forward expands every cached latent through `kv_b_proj` into
each head's key and value at every step: a decode step costs rows x longest row x kv_lora_rank x heads x
(key + value size) multiply-adds before attention reads a single column (GLM-5: 14.7 M per position and layer).
The up-projection is linear, so it can move to the query and the output instead ("absorbed"):

    score(h, t) = q_nope(h) . (W_UK(h) c_t) + q_rot(h) . k_rot_t = (W_UK(h)^T q_nope(h)) . c_t + q_rot(h) . k_rot_t
    out(h)      = sum_t p(h, t) W_UV(h) c_t = W_UV(h) (sum_t p(h, t) c_t)

so each head reads the latents themselves (kv_lora_rank + rope values a position: GLM-5 70 k multiply-adds a
position and layer over its 64 heads, 1/210 of the expansion), as multi-query attention with one shared key.

GLM-5 and DeepSeek-V3.2 attend only the columns their indexer picked (`index_topk` a row, the rest masked), so
their decode step reads just those latents (gathered from the rows' blocks where the cache is paged): attention
costs top-k, not the row's length, and the indexer's scores are what grows with the context.

Inside `absorbing(model)` (the batch's decode forward, a prompt's piece fed over what its cache holds, a reply
generated alone: `%%chat --no-batch`, the terminal chat) an MLA module's `expand_kv` returns stand-ins of the
expanded shape that own no memory (the forward reads only their shape, for GLM-5's top-k mask) and the `sdpa` entry
shardbook installs (`row_attention`) attends through `LatentKeys.attend` where that costs fewer multiply-adds
(`LatentKeys.cheaper`: always for one query a row). Everything else expands as transformers does: a whole prompt's
prefill (its queries share the expansion), a `kv_b_proj` that is not a plain linear layer (FP8 kept, a family's
own), one with hooks (an intervention or a capture on it must see its output), gradients wanted, another attention
implementation. The result equals the expanded attention up to the summation order
(tests/unit/test_latent_attention.py); `SHARDBOOK_MLA_ABSORBED=0` in the kernel's environment turns it off.
"""

from __future__ import annotations

import contextlib
import os
import types
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from shardbook.rankd.generation import paged_layers
from shardbook.rankd.generation.stand_ins import StandIns, stand_in
from shardbook.rankd.parallel.packed_linear import grad_wanted

SWITCH = "SHARDBOOK_MLA_ABSORBED"

_STAND_INS = StandIns("shardbook_latent_stand_ins")
"""Inside `absorbing`: the stand-ins MLA modules hand attention for their expanded keys and values."""
_HAS_MLA: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Whether a model has MLA modules (theirs given the deferring `expand_kv`), by model."""


@dataclass(frozen=True)
class LatentKeys:
    """One MLA module's cached latents for a step, behind the stand-ins its `expand_kv` returned: left-padded
    tensors, or the paged layer whose blocks hold them."""

    module: nn.Module
    latents: torch.Tensor | None  # (rows, 1, columns, kv_lora_rank)
    rotary: torch.Tensor | None  # (rows, 1, columns, qk_rope_head_dim)
    paged: Any = None

    def padded(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.paged.padded() if self.paged is not None else (self.latents, self.rotary)

    def expanded(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The keys and values transformers would have attended to."""
        return type(self.module).expand_kv(self.module, *self.padded())

    def cheaper(self, queries: int) -> bool:
        """Whether `queries` per row attend at fewer multiply-adds over the latents than expanded: the expansion
        costs kv_lora_rank x (nope + value size) a column and head, once; over the latents a query costs that
        (its up-projections), and each query and column 2 kv_lora_rank - nope - value size more than expanded
        attention does. Always, for a decode step; a prefill of a whole prompt never."""
        module = self.module
        columns = int(self.paged.block_table.lengths.max()) if self.paged is not None else self.latents.shape[2]
        up = module.kv_lora_rank * (module.qk_nope_head_dim + module.v_head_dim)
        extra = 2 * module.kv_lora_rank - module.qk_nope_head_dim - module.v_head_dim
        return queries == 1 or queries * (up + columns * extra) < columns * up

    def attend(self, query: torch.Tensor, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """Attention of the queries (rows, heads, queries, nope + rope) over the latents, as transformers' `sdpa`
        returns it: (rows, queries, heads, value size). No mask means causal, the queries the last positions."""
        module = self.module
        nope, heads = module.qk_nope_head_dim, query.shape[1]
        up = module.kv_b_proj.weight.view(heads, nope + module.v_head_dim, -1)  # the rank's heads under tp
        q_latent = torch.einsum("bhsn,hnc->bhsc", query[..., :nope], up[:, :nope])
        q_rot = query[..., nope:]
        picks = _picked_columns(module, mask)
        if picks is not None:
            out_latent = _over_latents(q_latent, q_rot, *self._columns(picks[0]), picks[1][:, None, None], scale)
        elif self.paged is None:
            out_latent = _over_latents(q_latent, q_rot, self.latents[:, 0], self.rotary[:, 0], mask, scale)
        else:
            out_latent = self._over_own_rows(q_latent, q_rot, mask, scale)
        return torch.einsum("bhsc,hvc->bshv", out_latent, up[:, nope:])

    def _columns(self, columns: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The latents and rotary keys at the given padded `columns` (rows, picks): each (rows, picks, size), read
        from a paged row's blocks where it holds them."""
        if self.paged is None:
            return tuple(_take(t[:, 0], columns) for t in (self.latents, self.rotary))
        return tuple(self.paged.at_columns(name, columns) for name in ("keys", "values"))  # a pad picked is masked

    def _over_own_rows(self, q_latent, q_rot, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
        """`_over_latents` row by row over each row's own blocks (no padding gathered)."""
        latents, rotary = self.paged.own_rows("keys"), self.paged.own_rows("values")
        outs = []
        for row, (latent, rot) in enumerate(zip(latents, rotary)):
            one = slice(row, row + 1)
            mine = None if mask is None else mask[one, ..., mask.shape[-1] - latent.shape[0] :]
            outs.append(_over_latents(q_latent[one], q_rot[one], latent[None], rot[None], mine, scale))
        return torch.cat(outs)


def _picked_columns(module: nn.Module, mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """A sparse-attention decode step's columns (GLM-5, DeepSeek-V3.2: the mask holds at most the indexer's top-k
    columns of each row): their indices (rows, top-k) and which of them the mask holds, or None where the mask
    is dense (no indexer, a prefill, fewer than twice top-k columns)."""
    topk = getattr(module.config, "index_topk", None)
    if not topk or mask is None or mask.dtype != torch.bool or mask.shape[2] != 1 or mask.shape[-1] < 2 * topk:
        return None
    own = mask[:, 0, 0]
    if int(own.sum(dim=-1).max()) > topk:  # not the indexer's mask after all
        return None
    held, columns = own.float().topk(topk, dim=-1)  # every held column, then others (any device sorts floats)
    return columns, held > 0


def _take(tensor: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """`tensor` (rows, columns, size) at `columns` (rows, picks): (rows, picks, size)."""
    return tensor.gather(1, columns[..., None].expand(-1, -1, tensor.shape[-1]))


def _over_latents(q_latent, q_rot, latents, rotary, mask: torch.Tensor | None, scale: float) -> torch.Tensor:
    """Softmax attention of (rows, heads, queries, size) queries over (rows, columns, size) latents and rotary keys,
    the latents also the values; `mask` (rows, 1, queries, columns) boolean or additive, or None for causal:
    (rows, heads, queries, kv_lora_rank)."""
    rows, heads, queries, _ = q_latent.shape
    flat = (rows, heads * queries, -1)  # every head reads the same latents: one multi-query attention a row
    scores = torch.baddbmm(
        torch.bmm(q_rot.reshape(flat), rotary.transpose(1, 2)), q_latent.reshape(flat), latents.transpose(1, 2)
    )
    scores = scores.view(rows, heads, queries, -1).mul_(scale)
    if mask is None and queries > 1:
        columns = scores.shape[-1]
        device = scores.device
        mask = torch.arange(columns, device=device) <= torch.arange(columns - queries, columns, device=device)[:, None]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores.float(), dim=-1).to(latents.dtype)
    return torch.bmm(weights.view(rows, heads * queries, -1), latents).view(rows, heads, queries, -1)


@contextlib.contextmanager
def absorbing(model: nn.Module) -> Iterator[None]:
    """The forwards of `model` inside attend over MLA's latents where `expand_kv` may defer (see the module's
    docstring); raise at the end if a stand-in never reached the attention entry that takes them (its output is
    not to be used). Entered through `row_attention.over_latents`, which installs that entry."""
    if os.environ.get(SWITCH, "1") == "0" or not _defer_in(model):
        yield
        return
    untaken = (
        "the batch handed this model's attention stand-ins for its expanded MLA keys and values, and the model "
        "changed them before attending: this model cannot attend over its latents directly; set "
        f"{SWITCH}=0 in the kernel's environment to expand them as transformers does"
    )
    with _STAND_INS.expected(untaken), paged_layers.latents_as_markers():
        yield


def take(key: torch.Tensor, value: torch.Tensor) -> LatentKeys | None:
    """The latents whose stand-ins `key` and `value` are (taken), or None when they are tensors."""
    return _STAND_INS.take(key, value)


def _defer_in(model: nn.Module) -> bool:
    """Give every MLA module of `model` the deferring `expand_kv` (once per model); whether it has any."""
    if model not in _HAS_MLA:
        modules = [m for m in model.modules() if hasattr(m, "kv_b_proj") and hasattr(type(m), "expand_kv")]
        for module in modules:
            module.expand_kv = types.MethodType(_expand_or_defer, module)
        _HAS_MLA[model] = bool(modules)
    return _HAS_MLA[model]


def _expand_or_defer(module: nn.Module, latents: torch.Tensor, rotary: torch.Tensor):
    """`expand_kv`, or inside `absorbing` where it applies, stand-ins of its shapes for `LatentKeys.attend`."""
    paged = paged_layers.take_markers(latents, rotary)
    if not _STAND_INS.active() or not _absorbable(module, latents):
        return LatentKeys(module, latents, rotary, paged).expanded()
    rows, _, columns, _ = latents.shape
    heads = module.kv_b_proj.weight.shape[0] // (module.qk_nope_head_dim + module.v_head_dim)
    key = stand_in(latents, rows, heads, columns, module.qk_nope_head_dim + module.qk_rope_head_dim)
    value = stand_in(latents, rows, heads, columns, module.v_head_dim)
    stored = LatentKeys(module, None, None, paged) if paged is not None else LatentKeys(module, latents, rotary)
    return _STAND_INS.hand(key, value, stored)


def _absorbable(module: nn.Module, latents: torch.Tensor) -> bool:
    """Whether the up-projection is a plain linear map of its weight that nothing observes, with no gradient wanted,
    under the attention entry that takes stand-ins."""
    up = module.kv_b_proj
    computes_linear = type(up) is nn.Linear or getattr(type(up).forward, "packs", False)
    return (
        getattr(module.config, "_attn_implementation", None) == "sdpa"
        and isinstance(up, nn.Linear)
        and computes_linear
        and up.bias is None
        and up.weight.dtype == latents.dtype
        and not (up._forward_hooks or up._forward_pre_hooks or _global_hooks())
        and not grad_wanted(latents, up.weight)
        and not torch.compiler.is_compiling()
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as torch_module

    return bool(torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks)
