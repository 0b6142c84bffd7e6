"""Expert parallelism for experts with biases, stored transposed with gate and up interleaved (GPT-OSS).

GPT-OSS keeps `gate_up_proj` as [experts, hidden, 2 x rows] with gate row k at column 2k and up
row k at 2k + 1, `gate_up_proj_bias` as [experts, 2 x rows], `down_proj` as [experts, rows, hidden]
and `down_proj_bias` as [experts, hidden]. The layout is `expert_parallel`'s: experts over `ep`,
each expert's rows over `efsdp`. Interleaving makes a rank's rows one contiguous range (2 x start
to 2 x stop) of gate_up's last dim and of its bias, so the biases split with the experts and their
rows. The down bias is added once per token and expert: by the ranks at efsdp index 0, since the
partial outputs of an expert's row slices are summed.
"""

from __future__ import annotations

from functools import cache

import torch
from torch import nn

from shardbook.rankd.parallel.expert_parallel import ExpertLayout
from shardbook.rankd.parallel.head_split import balanced_ranges
from shardbook.rankd.parallel.tp_modules import TPShard, become, copy_to_group, sum_over_group


def has_expert_biases(experts: nn.Module) -> bool:
    return hasattr(experts, "gate_up_proj_bias")


def biased_experts_plan(name: str, experts: nn.Module, layout: ExpertLayout) -> dict[str, TPShard]:
    """The slices of GPT-OSS's four expert tensors by `layout`."""
    num, _hidden, rows2 = experts.gate_up_proj.shape
    rows = rows2 // 2
    selections: dict[str, list] = {"gate_up_proj": [], "gate_up_proj_bias": [], "down_proj": [], "down_proj_bias": []}
    for rank in range(layout.parts):
        ep_index, efsdp_index = layout.position(rank)
        kept = (balanced_ranges(num, layout.ep)[ep_index],) if layout.ep > 1 else None
        part = balanced_ranges(rows, layout.efsdp)[efsdp_index]
        interleaved = (range(2 * part.start, 2 * part.stop),) if layout.efsdp > 1 else None
        selections["gate_up_proj"].append((kept, None, interleaved))
        selections["gate_up_proj_bias"].append((kept, interleaved))
        selections["down_proj"].append((kept, (part,) if layout.efsdp > 1 else None, None))
        selections["down_proj_bias"].append((kept, None))
    return {
        f"{name}.{param}": TPShard(tuple(getattr(experts, param).shape), tuple(chosen))
        for param, chosen in selections.items()
    }


def apply_biased_experts(experts: nn.Module, layout: ExpertLayout, rank: int, expert_group) -> None:
    """Give GPT-OSS's experts their expert-parallel forward."""
    ep_index, efsdp_index = layout.position(rank)
    mine = balanced_ranges(experts.gate_up_proj.shape[0], layout.ep)[ep_index]
    cls = _biased_parallel_class(type(experts))
    become(
        experts,
        cls,
        expert_group,
        expert_start=mine.start,
        adds_down_bias=efsdp_index == 0,
        bias_split=layout.efsdp > 1,
    )


class BiasedExpertParallel:
    """Mixed into GPT-OSS's experts class: this rank's experts and rows on their tokens, summed over the set."""

    tp_group: object
    expert_start: int
    adds_down_bias: bool
    bias_split: bool
    """Expert rows are split (ep_fsdp > 1), so one rank alone adds the down-projection bias."""

    def forward(self, hidden_states: torch.Tensor, router_indices=None, routing_weights=None) -> torch.Tensor:
        local = router_indices - self.expert_start
        wanted = hidden_states.requires_grad or any(p.requires_grad for p in self.parameters())
        if torch.is_grad_enabled() and wanted and getattr(self, "bias_split", False):
            # the bias added by one rank of each expert set has no gradient on the others: refuse, on every rank alike
            raise NotImplementedError(
                "gradients through GPT-OSS-style experts whose rows are split (ep_fsdp_size > 1, or the default "
                "expert split) are not supported under tp: the down-projection bias would get a wrong gradient. "
                "Load with parallel.decode gather or reshard, or parallel.ep_size equal to the tensor-parallel size"
            )
        hidden_states = copy_to_group(hidden_states, self.tp_group)
        routing_weights = copy_to_group(routing_weights, self.tp_group)
        out = torch.zeros_like(hidden_states)
        for expert in range(self.gate_up_proj.shape[0]):
            token_idx, k_pos = torch.where(local == expert)
            if token_idx.numel() == 0:
                continue
            gate_up = hidden_states[token_idx] @ self.gate_up_proj[expert] + self.gate_up_proj_bias[expert]
            expert_out = self._apply_gate(gate_up) @ self.down_proj[expert]
            if self.adds_down_bias:
                expert_out = expert_out + self.down_proj_bias[expert]
            out.index_add_(0, token_idx, (expert_out * routing_weights[token_idx, k_pos, None]).to(out.dtype))
        return sum_over_group(out, self.tp_group)


@cache
def _biased_parallel_class(base: type) -> type:
    return type(f"BiasedExpertParallel{base.__name__}", (BiasedExpertParallel, base), {})
