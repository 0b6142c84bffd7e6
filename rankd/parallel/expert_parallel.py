"""Expert parallelism in the `tp` layout: each rank keeps some experts, or a slice of each,
and one all-reduce joins them.

MindSpeed's `ep_size` and `ep_fsdp_size` lay the tensor-parallel group out as an expert mesh
(edp, efsdp, ep) of shape (ranks / (ep * ep_fsdp), ep_fsdp, ep), EP innermost: consecutive
ranks hold different experts. Here experts are split on the expert dim over `ep`, and each
expert's intermediate rows again over `ep_fsdp` (gate and up rows alike, the matching columns of
down), so a rank computes its experts' share for its rows without gathering anything; one
"expert set" of ep * ep_fsdp consecutive ranks holds every expert once, and edp sets replicate.

Dispatch: every rank runs `generate` on the same tokens, so each rank runs its own experts on
the tokens routed to them and one all-reduce over the expert set per MoE layer adds the partial
outputs (all-to-all would move the same bytes twice, out and back, for tokens every rank already
has). The experts' forward is shardbook's own loop over local experts: transformers' grouped
kernels leave rows routed elsewhere uninitialised unless told they run expert-parallel. LongCat-Flash's
zero-compute (identity) experts pass a token through, weighted: one rank per expert set adds them.

With the defaults (ep_size = ep_fsdp_size = 1) in a tensor-parallel group of N > 1 ranks, the
experts are split like a dense MLP: each expert's rows over all N ranks (ep_fsdp = N), so no rank
holds all experts of a layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from shardbook.rankd.parallel.head_split import balanced_ranges
from shardbook.rankd.parallel.tp_modules import TPShard, become, copy_to_group, sum_over_group


@dataclass(frozen=True)
class ExpertLayout:
    """How a tensor-parallel group of `parts` ranks holds the experts: `ep` experts groups, `efsdp` row slices."""

    parts: int
    ep: int
    efsdp: int

    @classmethod
    def of(cls, parts: int, ep_size: int, ep_fsdp_size: int) -> ExpertLayout:
        if ep_size == ep_fsdp_size == 1:
            return cls(parts, 1, parts)
        return cls(parts, ep_size, ep_fsdp_size)

    @property
    def set_size(self) -> int:
        """Ranks that hold every expert once between them (consecutive ranks)."""
        return self.ep * self.efsdp

    def position(self, rank: int) -> tuple[int, int]:
        """(ep index, efsdp index) of a rank of the group: EP innermost."""
        inside = rank % self.set_size
        return inside % self.ep, inside // self.ep

    def describe(self) -> str:
        edp = self.parts // self.set_size
        return f"experts: mesh (edp={edp}, efsdp={self.efsdp}, ep={self.ep}), one expert set = {self.set_size} rank(s)"


def expert_layout_problem(hf_config, parts: int, ep_size: int, ep_fsdp_size: int) -> str | None:
    """What makes `ep_size` x `ep_fsdp_size` impossible for this model on `parts` ranks, or None."""
    config = hf_config.get_text_config()
    experts = num_experts(config)
    if ep_size * ep_fsdp_size > 1 and experts is None:
        return (
            f"parallel.ep_size={ep_size} and ep_fsdp_size={ep_fsdp_size} apply to mixture-of-experts models, but "
            f"{config.model_type} has no experts: set both to 1"
        )
    if experts is None:
        return None
    layout = ExpertLayout.of(parts, ep_size, ep_fsdp_size)
    if parts % layout.set_size:
        return (
            f"parallel.ep_size x parallel.ep_fsdp_size = {ep_size} x {ep_fsdp_size} = {layout.set_size} does not "
            f"divide the {parts} ranks of the tensor-parallel group: pick sizes whose product divides {parts}"
        )
    if experts % layout.ep:
        return (
            f"parallel.ep_size={ep_size} does not divide the model's {experts} experts per layer: pick an ep_size "
            f"that divides {experts}"
        )
    if moe_intermediate(config) < layout.efsdp:
        return (
            f"ep_fsdp_size {layout.efsdp} is more than the experts' {moe_intermediate(config)} rows: pick a smaller one"
        )
    return None


def num_experts(config) -> int | None:
    for name in ("num_experts", "num_local_experts", "n_routed_experts"):
        if getattr(config, name, None):
            return int(getattr(config, name))
    return None


def moe_intermediate(config) -> int:
    return int(getattr(config, "moe_intermediate_size", None) or config.intermediate_size)


def experts_plan(name: str, experts: nn.Module, layout: ExpertLayout) -> dict[str, TPShard]:
    """The slices of one fused experts module (`gate_up_proj`, `down_proj`) by `layout`.

    Shared experts and routers are not here: the declared plan splits a shared expert like a
    dense MLP, and the router stays whole (every rank routes every token the same way).
    gate_up_proj's slots for zero-compute experts (LongCat-Flash) are never read: no checkpoint holds them.
    """
    slots, rows2, _hidden = experts.gate_up_proj.shape
    num = routed_experts(experts)
    rows = rows2 // 2
    gate_up, down = [], []
    for rank in range(layout.parts):
        ep_index, efsdp_index = layout.position(rank)
        mine = balanced_ranges(num, layout.ep)[ep_index]
        part = balanced_ranges(rows, layout.efsdp)[efsdp_index]
        experts_kept = (mine,) if layout.ep > 1 else None  # None: the whole dim (shows as not split)
        rows_kept = (part, range(rows + part.start, rows + part.stop)) if layout.efsdp > 1 else None
        gate_up.append((experts_kept if slots == num else (experts_kept or (range(num),)), rows_kept, None))
        down.append((experts_kept, None, (part,) if layout.efsdp > 1 else None))
    return {
        f"{name}.gate_up_proj": TPShard(tuple(experts.gate_up_proj.shape), tuple(gate_up)),
        f"{name}.down_proj": TPShard(tuple(experts.down_proj.shape), tuple(down)),
    }


EXPECTED_FLAGS = {
    "is_transposed": False,
    "is_concatenated": True,
    "has_bias": False,
    "has_gate": True,
    "has_post_expert_norm": False,
}
"""The expert-weight layout (transformers' ``use_experts_implementation`` flags) that :class:`ExpertParallel`'s
forward and :func:`experts_plan`'s slices assume: gate_up_proj [experts, 2 x intermediate, hidden] as [gate; up],
down_proj [experts, hidden, intermediate], no biases, no norm after each expert."""


def expert_weights_problem(experts: nn.Module) -> str | None:
    """Why ``experts`` stores its weights in a layout the expert-parallel forward does not handle, or None."""
    odd = [
        f"{flag}={getattr(experts, flag)}"
        for flag, expected in EXPECTED_FLAGS.items()
        if getattr(experts, flag, expected) != expected
    ]
    if not odd:
        return None
    return (
        f"{type(experts).__name__} stores its expert weights with {', '.join(odd)} (transformers' flags); "
        f"shardbook's expert parallelism assumes {', '.join(f'{k}={v}' for k, v in EXPECTED_FLAGS.items())}. "
        "Load this model with parallel.ep_size 1 and parallel.decode gather or reshard"
    )


def apply_experts(experts: nn.Module, layout: ExpertLayout, rank: int, expert_group) -> None:
    """Give a fused experts module its expert-parallel forward (this rank's experts, summed over the expert set)."""
    problem = expert_weights_problem(experts)
    if problem is not None:  # the same on every rank: the load's settle raises it everywhere
        raise ValueError(problem)
    ep_index, efsdp_index = layout.position(rank)
    mine = balanced_ranges(routed_experts(experts), layout.ep)[ep_index]
    cls = _expert_parallel_class(type(experts))
    become(experts, cls, expert_group, expert_start=mine.start, adds_identity=ep_index == efsdp_index == 0)


def routed_experts(experts: nn.Module) -> int:
    """Experts with weights; LongCat-Flash's gate_up_proj has slots for its zero-compute experts too, never used."""
    return int(getattr(experts, "num_routed_experts", None) or experts.down_proj.shape[0])


class ExpertParallel:
    """Mixed into a family's experts class: this rank's experts on the tokens routed to them, summed over the set."""

    tp_group: dist.ProcessGroup
    expert_start: int
    adds_identity: bool

    def forward(
        self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
    ) -> torch.Tensor:
        """Only the experts that received tokens, with one host sync for the whole layer (the counts per expert).

        The (token, k) pairs are sorted by expert (stably: token order kept, as ``torch.where`` gave it, so the
        sums are added in the same order), and each visited expert takes its slice of them.
        """
        num_local, top_k = self.down_proj.shape[0], top_k_index.shape[-1]
        flat = (top_k_index - self.expert_start).reshape(-1)
        flat = torch.where((flat >= 0) & (flat < num_local), flat, num_local)  # other ranks' experts: one bin past
        order = torch.argsort(flat, stable=True)
        counts = torch.zeros(num_local + 1, dtype=torch.long, device=flat.device)
        counts.scatter_add_(0, flat, torch.ones_like(flat))
        # replicated inputs to this rank's share of the experts: their gradients are summed over the set
        hidden_states, top_k_weights = (
            copy_to_group(hidden_states, self.tp_group),
            copy_to_group(top_k_weights, self.tp_group),
        )
        out = torch.zeros_like(hidden_states)
        if self.adds_identity:
            _add_identity_experts(self, out, hidden_states, top_k_index, top_k_weights)
        start = 0
        for expert, n in enumerate(counts[:num_local].tolist()):  # the layer's one host sync
            if n == 0:
                continue
            pairs, start = order[start : start + n], start + n
            token_idx, k_pos = pairs // top_k, pairs % top_k
            gate_up = self.expert_matmul(hidden_states[token_idx], "gate_up_proj", expert)
            expert_out = self.expert_matmul(_gated(self, gate_up), "down_proj", expert)
            out.index_add_(0, token_idx, (expert_out * top_k_weights[token_idx, k_pos, None]).to(out.dtype))
        return sum_over_group(out, self.tp_group)

    def expert_matmul(self, x: torch.Tensor, weight: str, expert: int) -> torch.Tensor:
        """`x @ W.T` for local `expert`'s `weight` (gate_up_proj or down_proj); `fp8_experts` computes it from
        FP8 codes."""
        return F.linear(x, getattr(self, weight)[expert])


def _gated(experts, gate_up: torch.Tensor) -> torch.Tensor:
    """act(gate) * up from a [gate rows, up rows] projection; the family's own `_apply_gate` where it has one
    (DeepSeek-V4 clamps gate and up first). Elementwise, so a rank's rows of gate and up give its rows."""
    apply_gate = getattr(experts, "_apply_gate", None)
    if apply_gate is not None:
        return apply_gate(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return experts.act_fn(gate) * up


def _add_identity_experts(experts, out, hidden_states, top_k_index, top_k_weights) -> None:
    """LongCat-Flash's zero-compute experts (indices past the routed ones) pass their tokens through, weighted;
    one rank of each expert set adds them, since the set's outputs are summed."""
    if not getattr(experts, "zero_expert_num", 0):
        return
    token_idx, k_pos = torch.where(top_k_index >= routed_experts(experts))
    out.index_add_(0, token_idx, (hidden_states[token_idx] * top_k_weights[token_idx, k_pos, None]).to(out.dtype))


@cache
def _expert_parallel_class(base: type) -> type:
    return type(f"ExpertParallel{base.__name__}", (ExpertParallel, base), {})
