"""Activation patching: how much of a metric each module and position carries from a clean prompt to a corrupt one.

`method="activation"`: batched forwards of the corrupt prompt with one row per module and position,
row (m, p) having module m's output at position p replaced by the clean run's; as many modules share
a forward as keep its logits within `LOGITS_BUDGET` (every layer of a small model at once). Every rank
patches its own piece of the output (under `tp` a split output's piece is what it captured from
the clean run), so nothing is gathered but the metric, which every rank computes alike from the
whole logits.

`method="attribution"` (attribution patching): one clean forward and one corrupt forward with a
backward, then `(clean - corrupt) . d metric / d output` per module and position, the first-order
estimate of the same table. Each rank sums over its piece of the features; one all-reduce over the
tensor-parallel group adds the split ones.

The metric is a function `fn(logits) -> scalar` every rank defined in `%%all`; the clean and corrupt
prompts must have the same number of tokens.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardbook.rankd.inspection.interventions import agreed_function, raise_failures
from shardbook.rankd.inspection.tracing import (
    GRAD_EXAMPLE,
    _capture_hook,
    _grad_from_embeddings,
    _refuse_non_tensors,
    agreed_metric,
    first_tensor,
    match_modules,
    prompt_ids,
)
from shardbook.rankd.parallel.wholes import activation_split

LOGITS_BUDGET = 256 << 20
"""Bytes of logits one patched forward may make (float32, every row and position)."""


def patch_sweep(model: nn.Module, tokenizer: Any, args: dict[str, Any], namespace: dict[str, Any]) -> dict[str, Any]:
    """The patching table (every rank computes it alike; rank 0 returns it): modules, tokens, the effect
    [modules, positions], the two baselines."""
    names = match_modules(model, args["modules"])
    metric = (agreed_function(model, namespace, args["metric"], GRAD_EXAMPLE), args["metric"])  # name for errors
    chat = args.get("chat", False)
    device = next(model.parameters()).device
    clean = prompt_ids(tokenizer, args["clean"], chat).to(device)
    corrupt = prompt_ids(tokenizer, args["corrupt"], chat).to(device)
    if clean.shape != corrupt.shape:
        raise ValueError(
            f"the clean prompt has {clean.shape[1]} tokens and the corrupt one {corrupt.shape[1]}: patching needs "
            "prompts of the same length (change words for words of one token each)"
        )
    method = args.get("method", "activation")
    if method not in ("activation", "attribution"):
        raise ValueError(f"--method {method!r}: choose activation or attribution")
    clean_out, clean_metric, _ = _run(model, names, clean, metric, grad=False)
    corrupt_out, corrupt_metric, grads = _run(model, names, corrupt, metric, grad=method == "attribution")
    names = [n for n in names if n in clean_out]
    if method == "attribution":
        effect = _attribution(model, names, clean_out, corrupt_out, grads) + corrupt_metric
    else:
        step = _modules_per_forward(model, corrupt.shape[1])
        groups = [names[i : i + step] for i in range(0, len(names), step)]
        effect = torch.cat([_patched(model, group, clean_out, corrupt, metric) for group in groups])
    raise_failures(model)
    if dist.get_rank() != 0:  # only rank 0's reply carries tensors (it never leaves its process)
        return {"modules": len(names)}
    tokens = [tokenizer.decode([i]) for i in corrupt[0].tolist()]
    return {
        "modules": names,
        "tokens": tokens,
        "clean_tokens": [tokenizer.decode([i]) for i in clean[0].tolist()],
        "effect": effect.cpu(),
        "clean_metric": clean_metric,
        "corrupt_metric": corrupt_metric,
        "method": method,
    }


def _run(model: nn.Module, names: list[str], ids: torch.Tensor, metric, grad: bool):
    """One forward capturing `names`' outputs (this rank's pieces); with `grad`, their gradients of the metric."""
    local: dict[str, torch.Tensor] = {}
    graph: dict[str, torch.Tensor] = {}
    hooks = [_grad_from_embeddings(model)] if grad else []
    hooks += [_capture_hook(model.get_submodule(n), n, False, local, graph if grad else None) for n in names]
    try:
        with torch.enable_grad() if grad else torch.no_grad():
            logits = model(ids).logits
            value = agreed_metric(lambda: [metric[0](logits)], metric[1])[0]
    finally:
        for hook in hooks:
            hook.remove()
    _refuse_non_tensors(local)
    if not grad:
        return local, float(value), {}
    wanted = [n for n in names if n in graph and graph[n].requires_grad]
    found = torch.autograd.grad(value, [graph[n] for n in wanted], allow_unused=True) if wanted else []
    grads = {n: torch.zeros_like(local[n]) if g is None else g.detach() for n, g in zip(wanted, found)}
    return local, float(value.detach()), grads


def _modules_per_forward(model: nn.Module, positions: int) -> int:
    """How many modules' rows (one per position each) one patched forward takes, its logits within the budget."""
    vocab = model.config.get_text_config().vocab_size
    return max(1, LOGITS_BUDGET // (positions * positions * vocab * 4))


def _patched(model: nn.Module, names: list[str], clean: dict, corrupt: torch.Tensor, metric) -> torch.Tensor:
    """[modules, positions]: the metric with module m's output at position p taken from the clean run, for every m
    and p, in one batched forward whose row m * positions + p is that patch (each module's hook patches its rows)."""
    positions = corrupt.shape[1]

    def hook_for(index: int, name: str):
        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            out = first_tensor(output).clone()
            at = torch.arange(positions, device=out.device)
            out[index * positions + at, at] = clean[name][0, at].to(out.dtype)
            return (out, *output[1:]) if isinstance(output, tuple) else out

        return hook

    handles = [model.get_submodule(n).register_forward_hook(hook_for(i, n)) for i, n in enumerate(names)]
    try:
        with torch.no_grad():
            logits = model(corrupt.expand(len(names) * positions, -1)).logits
    finally:
        for handle in handles:
            handle.remove()
    fn, metric_name = metric
    rows = range(len(names) * positions)
    values = agreed_metric(lambda: [fn(logits[r : r + 1]) for r in rows], metric_name)
    return values.float().view(len(names), positions)


def _attribution(model: nn.Module, names: list[str], clean: dict, corrupt: dict, grads: dict) -> torch.Tensor:
    """(clean - corrupt) . gradient, summed over features: [modules, positions], whole on every rank."""
    rows = []
    for name in names:
        diff = (clean[name] - corrupt[name]).float()
        grad = grads.get(name, torch.zeros_like(diff)).float()
        value = (diff * grad).flatten(2).sum(-1)[0]
        split = activation_split(model, name, False)
        if split is not None:  # each rank summed its own features (shared KV heads refuse gradients under tp)
            value = value.contiguous()
            dist.all_reduce(value, group=split.group)
        rows.append(value)
    return torch.stack(rows)
