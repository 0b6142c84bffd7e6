"""One all-reduce per MoE layer under `tp`: the shared experts' partial output joins the routed experts' before the sum.

Under `tp` a shared expert is split like a dense MLP, so its down_proj gives each rank a partial
sum, and so do the routed experts (`ExpertParallel`). Every family shardbook splits (Qwen2-MoE,
Qwen3-Next, DeepSeek-V3/V3.2/V4, GLM-4-MoE, GLM-5) ends its MoE block with routed + shared
(Qwen's shared expert scaled per token by a gate computed from the whole input): a sum of the two
partials. So the block runs with both sums left to it (`sums_left_to_caller`) and makes one
all-reduce of its output instead of two.

Only without autograd (generation, inspection under `no_grad`): the sum is right for the forward, but
Qwen's gate multiplies the shared partial, so its gradient needs the whole shared output. And what a
trace or an intervention sees inside the block must stay whole: while any hook watches a module
inside it (or a global module hook is set), the block also runs the two sums as before.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.modules import module as torch_module

from shardbook.rankd.parallel.expert_parallel import ExpertParallel
from shardbook.rankd.parallel.tp_modules import RowParallelLinear, become, sum_over_group, sums_left_to_caller

SHARED_NAMES = ("shared_experts", "shared_expert")


def maybe_fold_shared_experts(block: nn.Module, group: dist.ProcessGroup) -> bool:
    """Give `block` (a layer's MoE block, parallel modules already in place) one sum for both kinds of experts.

    Only when its routed experts and its shared expert's down_proj both sum over `group` (an
    expert set smaller than the tensor-parallel group sums over its own group), the shared
    down_proj has no bias (added after the sum, once), and nothing else inside the block sums.
    """
    shared = next((getattr(block, name) for name in SHARED_NAMES if hasattr(block, name)), None)
    experts = getattr(block, "experts", None)
    if shared is None or not isinstance(experts, ExpertParallel) or experts.tp_group is not group:
        return False
    down = getattr(shared, "down_proj", None)
    if not isinstance(down, RowParallelLinear) or down.tp_group is not group or down.bias is not None:
        return False
    summing = [m for m in block.modules() if isinstance(m, (ExpertParallel, RowParallelLinear))]
    if len(summing) != 2:
        return False
    become(block, _one_sum_class(type(block)), group, inner_modules=[m for m in block.modules() if m is not block])
    return True


class OneSumMoE:
    """Mixed into a family's MoE block: routed and shared experts' partial outputs summed by one all-reduce."""

    tp_group: dist.ProcessGroup
    inner_modules: list[nn.Module]

    def forward(self, *args, **kwargs):
        if torch.is_grad_enabled() or self._watched():
            return super().forward(*args, **kwargs)
        with sums_left_to_caller(self.tp_group):
            out = super().forward(*args, **kwargs)
        if isinstance(out, tuple):  # (hidden states, router logits) in some families
            return (sum_over_group(out[0], self.tp_group), *out[1:])
        return sum_over_group(out, self.tp_group)

    def _watched(self) -> bool:
        """A hook inside the block would see a partial sum: then the parts sum their outputs themselves."""
        if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
            return True
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.inner_modules)


@cache
def _one_sum_class(base: type) -> type:
    return type(f"OneSum{base.__name__}", (OneSumMoE, base), {})
