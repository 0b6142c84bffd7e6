"""`trace`: one forward on every rank, capturing chosen modules' outputs, whole on rank 0 under every layout.

Every rank runs the same steps in the same order: match the globs (a bad glob fails on every
rank before any collective), hook the modules, run one forward, check the capture against the
size limit (the same sums on every rank), then join the split activations on rank 0. The logit
lens runs inside the same forward, in a hook on the output layer, where FSDP2 still holds the
final norm and the output weights gathered and `tp`'s output layer gathers the whole vocabulary.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardbook.rankd.control.agreement import agree
from shardbook.rankd.inspection.interventions import agreed_function, raise_failures
from shardbook.rankd.parallel.layout import decoder_layers
from shardbook.rankd.parallel.wholes import activation_split, gather_whole_to_rank0, whole_shape

DEFAULT_MAX_BYTES = 1 << 30


class Trace(Mapping):
    """Module name -> whole captured tensor (on CPU), plus the prompt's tokens and the model's logits.

    A read-only mapping, not a dict: replies are cleaned of invalid text by rebuilding their
    dicts, and a trace must reach the user as it is.
    """

    def __init__(
        self,
        captures: dict[str, torch.Tensor],
        *,
        token_ids: list[int],
        tokens: list[str],
        logits: torch.Tensor,
        inputs: bool,
        lens: Lens | None = None,
        stats: dict[str, Any] | None = None,
        grads: dict[str, torch.Tensor] | None = None,
        metric: float | None = None,
    ):
        self.captures = captures
        self.grads, self.metric = grads, metric
        """With `--grad`: each capture's gradient of the metric (whole, like the captures), and the metric's value."""
        self.token_ids, self.tokens, self.logits, self.inputs = token_ids, tokens, logits, inputs
        self.lens, self.stats = lens, stats or {}

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.captures[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.captures)

    def __len__(self) -> int:
        return len(self.captures)

    def __repr__(self) -> str:
        what = "inputs" if self.inputs else "outputs"
        shapes = ", ".join(f"{name}: {tuple(t.shape)}" for name, t in list(self.items())[:4])
        more = f", … ({len(self)} modules)" if len(self) > 4 else ""
        grads = "" if self.grads is None else f", with gradients of a metric = {self.metric:.4g}"
        logits = tuple(self.logits.shape)
        return f"Trace of {len(self.tokens)} tokens, {what} of {{{shapes}{more}}}, logits {logits}{grads}"


@dataclass
class Lens:
    """The logit lens: for each traced layer and position, the top tokens and their probabilities."""

    layers: list[str]
    token_ids: torch.Tensor
    """[layers, positions, top] most likely next-token ids after projecting that layer's residual stream."""
    probs: torch.Tensor
    """[layers, positions, top] their probabilities."""
    tokens: list[list[list[str]]] = field(default_factory=list)


def glob_pattern(glob: str) -> re.Pattern:
    """`*` matches one dotted name part, `**` any number of them, `?` one character: `model.layers.*` is every layer."""
    out = ""
    for part in re.split(r"(\*\*|\*|\?)", glob):
        out += {"**": ".*", "*": "[^.]*", "?": "[^.]"}.get(part, re.escape(part))
    return re.compile(out + r"\Z")


def match_modules(model: nn.Module, globs: list[str]) -> list[str]:
    """Module names matching any glob, in model order; a glob matching nothing is an error naming examples."""
    names = [name for name, _ in model.named_modules() if name]
    found: list[str] = []
    for glob in globs:
        pattern = glob_pattern(glob)
        hits = [name for name in names if pattern.match(name)]
        if not hits:
            examples = ", ".join(layer_names(model)[:2] + [n for n in names if n.count(".") == 3][:2])
            raise ValueError(
                f"no module of the model matches {glob!r}: `*` stands for one part of a dotted name and `**` "
                f"for any number of them (e.g. model.layers.* or model.layers.3.self_attn); names look like "
                f"{examples}. model.named_modules() lists them all"
            )
        found += [h for h in hits if h not in found]
    order = {name: i for i, name in enumerate(names)}
    return sorted(found, key=order.__getitem__)


def layer_names(model: nn.Module) -> list[str]:
    """The decoder layers' module names, in order."""
    layers = {id(m) for m in decoder_layers(model)}
    return [name for name, m in model.named_modules() if id(m) in layers]


def first_tensor(value: Any) -> Any:
    """A module's output or positional input as one tensor:
    the first of a tuple (hidden states, not attention weights).

    A model's output (`BaseModelOutputWithPast` of `model.model`, a `ModelOutput`) gives its first
    field (`last_hidden_state`). What is still not a tensor is returned as it is, and refused by `trace`.
    """
    while True:
        if isinstance(value, (tuple, list)) and value:
            value = value[0]
        elif isinstance(value, Mapping) and value:  # ModelOutput is an OrderedDict of its fields that are set
            value = next(iter(value.values()))
        else:
            return value


GRAD_EXAMPLE = "(logits):\n    return logits[0, -1, 1000] - logits[0, -1, 2000]"


def trace(
    model: nn.Module, tokenizer: Any, args: dict[str, Any], namespace: dict[str, Any] | None = None
) -> Trace | dict[str, Any]:
    """Run `args`' trace on this rank; rank 0 returns the `Trace`, the others a small summary.

    With `args["grad"]` (the name of a function of the logits defined on every rank, returning a scalar), the
    forward keeps a graph and every capture's gradient of that metric is gathered whole too; parameters'
    `.grad` are left as they were.
    """
    names = match_modules(model, args.get("modules") or layer_names(model))
    metric_fn = agreed_function(model, namespace or {}, args["grad"], GRAD_EXAMPLE) if args.get("grad") else None
    ids = prompt_ids(tokenizer, args["prompt"], args.get("chat", False)).to(next(model.parameters()).device)
    inputs = bool(args.get("inputs"))
    lens_top = args.get("lens_top")
    local: dict[str, torch.Tensor] = {}
    lens_out: dict[str, tuple] = {}
    graph: dict[str, torch.Tensor] = {}
    hooks = [_grad_from_embeddings(model)] if metric_fn else []  # first: the embedding's own capture sees its result
    hooks += [_capture_hook(model.get_submodule(n), n, inputs, local, graph if metric_fn else None) for n in names]
    if lens_top:
        hooks.append(_lens_hook(model, names, lens_top, local, lens_out))
    started = time.perf_counter()
    try:
        with torch.enable_grad() if metric_fn else torch.no_grad():
            logits = model(ids).logits
    finally:
        for hook in hooks:
            hook.remove()
    forward_s = time.perf_counter() - started
    _refuse_non_tensors(local)
    names = [n for n in names if n in local]  # containers such as model.layers never run forward themselves
    splits = {n: activation_split(model, n, inputs) for n in names}
    check_size(local, splits, logits, args.get("max_bytes", DEFAULT_MAX_BYTES) // (2 if metric_fn else 1))
    grads, metric = _gradients(metric_fn, args.get("grad"), logits, names, graph) if metric_fn else (None, None)
    logits = logits.detach()
    wholes, sent = {}, 0
    for name in names:
        whole, nbytes = _to_rank0(local[name], splits[name])
        wholes[name], sent = whole, sent + nbytes
    whole_grads = {}
    for name in grads or {}:
        whole_grads[name], nbytes = _to_rank0(grads[name], splits[name])
        sent += nbytes
    raise_failures(model)
    if torch.distributed.get_rank() != 0:
        return {"modules": len(names)}
    stats = {"forward_s": forward_s, "total_s": time.perf_counter() - started, "bytes_to_rank0": sent}
    token_ids = ids[0].tolist()
    return Trace(
        {n: t.cpu() for n, t in wholes.items()},
        token_ids=token_ids,
        tokens=[tokenizer.decode([i]) for i in token_ids],
        logits=logits[0].float().cpu(),
        inputs=inputs,
        lens=_lens(tokenizer, names, lens_out),
        stats=stats,
        grads={n: t.cpu() for n, t in whole_grads.items()} if metric_fn else None,
        metric=metric,
    )


def _grad_from_embeddings(model: nn.Module):
    """Make the input embedding's output require grad, so captures have gradients even with frozen parameters."""

    def hook(module: nn.Module, args: tuple, out: torch.Tensor) -> torch.Tensor | None:
        if not out.requires_grad:
            return out.detach().requires_grad_(True)
        return None

    return model.get_input_embeddings().register_forward_hook(hook)


def _gradients(metric_fn, name: str, logits: torch.Tensor, names: list[str], graph: dict[str, torch.Tensor]):
    """Each captured tensor's gradient of `metric_fn(logits)` (a scalar); the same backward on every rank."""
    value = agreed_metric(lambda: [metric_fn(logits)], name)[0]
    wanted = [n for n in names if n in graph and graph[n].requires_grad]
    found = torch.autograd.grad(value, [graph[n] for n in wanted], allow_unused=True) if wanted else []
    grads = {n: (torch.zeros_like(graph[n]) if g is None else g).detach() for n, g in zip(wanted, found)}
    for n in names:  # a capture the metric does not depend on (after the logits, or cut off): zero gradient
        grads.setdefault(n, torch.zeros_like(graph[n]) if n in graph else torch.zeros(()))
    return grads, float(value.detach())


def agreed_metric(compute: Callable[[], list[Any]], name: str) -> torch.Tensor:
    """The metric's values (`compute()` gives a list of scalar tensors) stacked, once every rank computed them: where
    the metric raised or gave no scalar on any rank, every rank raises (the failing rank its cause, the others naming
    it) before any backward or further forward, whose collectives the failed rank would never join."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0

    def prepare() -> tuple[torch.Tensor, str]:
        try:
            values = compute()
        except Exception as e:
            raise ValueError(
                f"the metric {name!r} raised on rank {rank}: {type(e).__name__}: {e}. It runs on every rank, on the "
                f"whole logits: fix it in %%all and run again"
            ) from e
        odd = [v for v in values if not isinstance(v, torch.Tensor) or v.numel() != 1]
        if odd:
            got = tuple(odd[0].shape) if isinstance(odd[0], torch.Tensor) else type(odd[0]).__name__
            raise ValueError(
                f"the metric {name!r} must return a scalar tensor computed from the logits; on rank {rank} it "
                f"returned {got}"
            )
        return torch.stack([v.reshape(()) for v in values]), ""

    return agree(prepare, f"compute the metric {name!r}")


def prompt_ids(tokenizer: Any, prompt: str, chat: bool) -> torch.Tensor:
    """The prompt's token ids, [1, positions]: raw text, or one user message in the chat template."""
    if chat:
        from shardbook.rankd.generation.engine import build_prompt_ids

        return build_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def _refuse_non_tensors(local: dict[str, Any]) -> None:
    """Raise (on every rank alike: the same modules return the same kinds) for a capture that is not a tensor."""
    odd = {name: type(value).__name__ for name, value in local.items() if not isinstance(value, torch.Tensor)}
    if odd:
        listed = ", ".join(f"{name} ({kind})" for name, kind in list(odd.items())[:3])
        raise ValueError(
            f"{len(odd)} matched module(s) return no tensor to capture, e.g. {listed}: "
            "narrow --modules to modules that return tensors (e.g. model.layers.*)"
        )


def _capture_hook(module: nn.Module, name: str, inputs: bool, into: dict[str, torch.Tensor], graph=None):
    """Keep the module's output (or first input), detached; with `graph`, also the tensor itself for its gradient."""

    def keep(value: Any) -> None:
        into[name] = _detached(value)
        if graph is not None and isinstance(value, torch.Tensor):
            graph[name] = value

    if inputs:
        return module.register_forward_pre_hook(lambda m, a, kw: keep(_input_of(a, kw)), with_kwargs=True)
    return module.register_forward_hook(lambda m, a, out: keep(first_tensor(out)))


def _detached(value: Any) -> Any:
    return value.detach() if isinstance(value, torch.Tensor) else value


def _input_of(args: tuple, kwargs: dict[str, Any]) -> torch.Tensor:
    """The first positional input, or `hidden_states` when a layer takes it by keyword."""
    if args:
        return first_tensor(args)
    return first_tensor(kwargs.get("hidden_states", next(iter(kwargs.values()))))


def check_size(local: dict[str, torch.Tensor], splits: dict[str, Any], logits: torch.Tensor, max_bytes: int) -> None:
    """Refuse (on every rank alike) a capture whose whole tensors would exceed `max_bytes` on rank 0."""
    total = logits.numel() * 4 + sum(
        int(torch.Size(whole_shape(t.shape, splits[n])).numel()) * t.element_size() for n, t in local.items()
    )
    if total > max_bytes:
        raise ValueError(
            f"this capture needs {total / 2**20:.1f} MiB on rank 0, over the limit of {max_bytes / 2**20:.1f} MiB; "
            "capture fewer modules (--modules), a shorter prompt, or raise the limit (--max-mb)"
        )


def _to_rank0(local: torch.Tensor, split) -> tuple[torch.Tensor | None, int]:
    if split is None:
        return local, 0
    return gather_whole_to_rank0(local, split)


def _lens_hook(model: nn.Module, names: list[str], top: int, captured: dict[str, torch.Tensor], out: dict[str, tuple]):
    """On the output layer: project each captured layer's stream through the final norm and the unembedding."""
    norm = model.get_decoder().norm

    def project(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        for name in names:
            if not isinstance(captured.get(name), torch.Tensor):
                continue  # refused (not a tensor) or never run: left out after the forward
            stream = norm(captured[name])
            logits = type(module).forward(module, stream)  # its own forward, without re-running hooks
            probs = torch.softmax(logits[0].float(), dim=-1)
            best = torch.topk(probs, k=min(top, probs.shape[-1]), dim=-1)
            out[name] = (best.indices, best.values)

    return model.get_output_embeddings().register_forward_hook(project)


def _lens(tokenizer: Any, names: list[str], out: dict[str, tuple]) -> Lens | None:
    names = [n for n in names if n in out]
    if not names:
        return None
    ids = torch.stack([out[n][0] for n in names]).cpu()
    probs = torch.stack([out[n][1] for n in names]).cpu()
    tokens = [[[tokenizer.decode([i]) for i in pos.tolist()] for pos in layer] for layer in ids]
    return Lens(layers=names, token_ids=ids, probs=probs, tokens=tokens)
