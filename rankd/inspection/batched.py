"""Traces of many prompts: batched forwards, per-prompt results, reductions on the ranks, captures streamed to files.

Prompts run `batch_size` at a time, padded on the right with an attention mask: under a causal mask a
real token never sees the padding after it, and positions count from 0 as in a one-prompt run, so
every prompt's captures are what a one-prompt trace gives (within float rounding), cut to its own
length.

With `reduce` (mean, sum, max, var), each rank reduces its own capture over every real token of
every prompt (or of each prompt, `per_prompt`) as the batches go, so only the reduced tensors are
gathered to rank 0 at the end: under `tp` a split capture is reduced piece by piece (reductions
over tokens commute with a split along features). `project` multiplies each capture by a shared
matrix [features, k] first (a split capture is gathered whole on every rank for that). With `to`,
rank 0 writes each batch's unreduced captures to a safetensors file and keeps none of them.

A reduction under `gather` or `reshard` splits the prompts between the ranks: every rank holds
(or all-gathers) the whole model and computes whole activations, and the only collectives in a
forward are the weights' all-gathers, which do not depend on the input. So each rank runs its own
batches (rank r the r-th of every round of world-size batches; a rank left without one runs a
one-token forward, so every rank makes the same calls) and the partial sums, squares, counts and
maxima are all-reduced once at the end. Under `tp` every rank must feed the same tokens, so the
ranks run every batch together; so do traces whose captures go to rank 0 whole.

After each round every rank learns whether any was interrupted (one all-reduce), so all stop after
the same round and what finished is kept: always the first prompts, in order.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardbook.rankd.inspection.interventions import agree, raise_failures
from shardbook.rankd.inspection.tracing import (
    DEFAULT_MAX_BYTES,
    Trace,
    _capture_hook,
    _refuse_non_tensors,
    _to_rank0,
    layer_names,
    match_modules,
    prompt_ids,
)
from shardbook.rankd.parallel.wholes import activation_split, all_gather_whole, tp_group, whole_shape

REDUCTIONS = ("mean", "sum", "max", "var")
DEFAULT_BATCH_SIZE = 8


class Traces(Sequence):
    """One `Trace` per prompt that finished, in the prompts' order; `interrupted` when the run stopped early."""

    def __init__(self, traces: list[Trace], *, total: int, interrupted: bool, stats: dict[str, Any]):
        self.traces, self.total, self.interrupted, self.stats = traces, total, interrupted, stats

    def __getitem__(self, index):
        return self.traces[index]

    def __len__(self) -> int:
        return len(self.traces)

    def __repr__(self) -> str:
        done = f"{len(self)} of {self.total} prompts" + (" (interrupted)" if self.interrupted else "")
        first = f"; first: {self.traces[0]!r}" if self.traces else ""
        return f"Traces of {done}{first}"


class Reduced(Mapping):
    """Module name -> a capture reduced over tokens (`op`): [features], or [prompts, features] with `per_prompt`.

    `tokens` is how many real tokens went in (per prompt with `per_prompt`); `prompts` how many prompts finished.
    """

    def __init__(self, values: dict[str, torch.Tensor], *, op: str, per_prompt: bool, tokens, prompts: int, **kw):
        self.values, self.op, self.per_prompt, self.tokens, self.prompts = values, op, per_prompt, tokens, prompts
        self.total, self.interrupted, self.stats = kw["total"], kw["interrupted"], kw["stats"]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.values[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self.values)

    def __len__(self) -> int:
        return len(self.values)

    def __repr__(self) -> str:
        shapes = ", ".join(f"{n}: {tuple(t.shape)}" for n, t in list(self.items())[:4])
        more = f", … ({len(self)} modules)" if len(self) > 4 else ""
        stop = " (interrupted)" if self.interrupted else ""
        return f"Reduced ({self.op}) over {self.prompts} of {self.total} prompts{stop}: {{{shapes}{more}}}"


def read_prompts_file(path: str | Path) -> list[str]:
    """The `prompt` of each line of a JSON-lines file; a bad line is an error naming it."""
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}, line {number}: not JSON ({e.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise ValueError(
                f'{path}, line {number}: expected an object with a "prompt" string, like {{"prompt": "…"}}'
            )
        prompts.append(record["prompt"])
    if not prompts:
        raise ValueError(f"{path} has no prompts (one JSON object per line with a prompt field)")
    return prompts


def trace_many(
    model: nn.Module,
    tokenizer: Any,
    args: dict[str, Any],
    namespace: dict[str, Any] | None = None,
    stop_event: threading.Event | None = None,
) -> Traces | Reduced | dict[str, Any]:
    """Run `args["prompts"]` in batches on this rank; rank 0 returns `Traces` (or `Reduced`), the others a summary."""
    prompts = list(args["prompts"])
    if not prompts or not all(isinstance(p, str) for p in prompts):
        raise ValueError("prompts must be a non-empty list of strings")
    names = match_modules(model, args.get("modules") or layer_names(model))
    op, per_prompt = args.get("reduce"), bool(args.get("per_prompt"))
    if op is not None and op not in REDUCTIONS:
        raise ValueError(f"--reduce {op!r}: choose one of {', '.join(REDUCTIONS)}")
    if args.get("lens_top") or args.get("grad"):
        raise ValueError("the logit lens and --grad take one prompt: leave out --prompts / --in")
    project = _shared_matrix(model, namespace or {}, args["project"]) if args.get("project") else None
    batch_size = max(1, int(args.get("batch_size") or DEFAULT_BATCH_SIZE))
    inputs = bool(args.get("inputs"))
    device = next(model.parameters()).device
    ids = [prompt_ids(tokenizer, p, args.get("chat", False))[0] for p in prompts]
    if op is not None and not per_prompt:  # the order of prompts does not matter: similar lengths share a batch
        ids.sort(key=len)
    logits_wanted = op is None and args.get("to") is None
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    out_dir = Path(args["to"]) if args.get("to") else None
    rank0 = dist.get_rank() == 0
    if out_dir is not None and rank0:
        out_dir.mkdir(parents=True, exist_ok=True)
    if op is None:
        _refuse_oversized(model, names, inputs, ids, batch_size if out_dir else None, args.get("max_bytes"))
    reducer = _Reducer(op, per_prompt, len(prompts), project) if op else None
    traces: list[Trace] = []
    files: list[str] = []
    stats = {"forward_s": 0.0, "bytes_to_rank0": 0, "batches": 0}
    started = time.perf_counter()
    world, me = (dist.get_world_size(), dist.get_rank()) if reducer and _ranks_split_prompts(model) else (1, 0)
    stats["ranks_sharing_prompts"] = world
    rounds = range(0, len(prompts), batch_size * world)
    progress = _progress(len(prompts), rank0 and len(rounds) > 1)
    interrupted, splits, done = False, None, 0
    try:
        for first in rounds:
            start = first + me * batch_size
            chunk = ids[start : start + batch_size] or [ids[0][:1]]  # a one-token forward when none is left here
            batch, mask = _right_padded(chunk, pad, device)
            local, logits, seconds = _forward(model, names, inputs, batch, mask, logits_wanted)
            stats["forward_s"] += seconds
            names = [n for n in names if n in local]
            if splits is None:
                splits = {n: activation_split(model, n, inputs) for n in names}
            if reducer is not None:
                reducer.add(local, splits, mask, start if start < len(prompts) else None)
            else:
                wholes = {}
                for name in names:
                    wholes[name], nbytes = _to_rank0(local[name], splits[name])
                    stats["bytes_to_rank0"] += nbytes
                if rank0:
                    per = _per_prompt(tokenizer, wholes, logits, chunk, inputs)
                    if out_dir is not None:
                        files.append(_write(out_dir, start, per))
                    else:
                        traces += per
            raise_failures(model)
            stats["batches"] += 1
            done = min(len(prompts), first + batch_size * world)
            progress.update(done - first)
            if _any_rank_stopped(stop_event, device) and done < len(prompts):
                interrupted = True
                break
    finally:
        progress.close()
    if reducer is not None:
        stats["bytes_to_rank0"] += reducer.combine_ranks(world, names, model)
        values, nbytes = reducer.finish(splits or {}, done)
        stats["bytes_to_rank0"] += nbytes
    stats["total_s"] = time.perf_counter() - started
    if not rank0:
        return {"modules": len(names), "prompts": done}
    if reducer is not None:
        tokens = reducer.counts[:done] if per_prompt else int(reducer.counts.sum())
        stats["bytes_result"] = sum(t.numel() * t.element_size() for t in values.values())
        return Reduced(
            {n: t.cpu() for n, t in values.items()},
            op=op,
            per_prompt=per_prompt,
            tokens=tokens.tolist() if per_prompt else tokens,
            prompts=done,
            total=len(prompts),
            interrupted=interrupted,
            stats=stats,
        )
    if out_dir is not None:
        stats["files"] = files
    return Traces(traces, total=len(prompts), interrupted=interrupted, stats=stats)


def _ranks_split_prompts(model: nn.Module) -> bool:
    """Whether the ranks may run different prompts: more than one rank and no tensor-parallel split (FSDP2)."""
    return dist.is_initialized() and dist.get_world_size() > 1 and tp_group(model) is None


def _right_padded(chunk: list[torch.Tensor], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """One batch of prompts padded on the right, and its attention mask."""
    lengths = [len(t) for t in chunk]
    batch = torch.full((len(chunk), max(lengths)), pad, dtype=torch.long)
    mask = torch.zeros_like(batch)
    for row, tokens in enumerate(chunk):
        batch[row, : len(tokens)], mask[row, : len(tokens)] = tokens, 1
    return batch.to(device), mask.to(device)


def _shared_matrix(model: nn.Module, namespace: dict[str, Any], name: str) -> torch.Tensor:
    """The projection matrix `name` [features, k] from this rank's namespace, once every rank has one."""
    value = namespace.get(name)
    problem = None
    if not isinstance(value, torch.Tensor) or value.dim() != 2:
        problem = (
            f"--project {name}: no matrix [features, k] of that name on rank {dist.get_rank()}: make one on rank 0 "
            f"and copy it to every rank with %share {name}"
        )
    agree(problem, model)
    return value


def _forward(model: nn.Module, names: list[str], inputs: bool, ids: torch.Tensor, mask: torch.Tensor, logits: bool):
    """One batch's forward with the captures' hooks; without `logits`, the output layer runs on the last position
    only (unless it is captured itself), which spares the largest matmul and, under `tp`, the vocabulary's gather."""
    local: dict[str, torch.Tensor] = {}
    hooks = [_capture_hook(model.get_submodule(n), n, inputs, local) for n in names]
    head = model.get_output_embeddings()
    keep = 0 if logits or any(model.get_submodule(n) is head for n in names) else 1
    started = time.perf_counter()
    try:
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, logits_to_keep=keep).logits
    finally:
        for hook in hooks:
            hook.remove()
    _refuse_non_tensors(local)
    return local, logits, time.perf_counter() - started


def _refuse_oversized(model: nn.Module, names, inputs: bool, ids, batch_size: int | None, max_bytes) -> None:
    """Before any forward over the prompts: refuse (on every rank alike) a run whose captures and logits would not fit
    on rank 0: all of them, or with `--to` one batch's. A one-token forward measures the bytes per token; the limit is
    `max_bytes` or rank 0's free memory, whichever is smaller."""
    device = next(model.parameters()).device
    one = ids[0][:1].view(1, 1).to(device)
    local, logits, _ = _forward(model, names, inputs, one, torch.ones_like(one), True)
    _refuse_non_tensors(local)
    per_token = logits.numel() * 4 + sum(
        int(torch.Size(whole_shape(t.shape, activation_split(model, n, inputs))).numel()) * t.element_size()
        for n, t in local.items()
    )
    tokens = sum(len(t) for t in ids) if batch_size is None else batch_size * max(len(t) for t in ids)
    free = torch.tensor([float(_free_memory()) if dist.get_rank() == 0 else 0.0], dtype=torch.float64, device=device)
    if dist.get_world_size() > 1:
        dist.broadcast(free, src=0)  # rank 0's figure, so that every rank decides alike
    limit = min(max_bytes or DEFAULT_MAX_BYTES, int(free.item()))
    if per_token * tokens > limit:
        what = "one batch" if batch_size is not None else f"these {len(ids)} prompts"
        over = "the --max-mb limit" if limit == (max_bytes or DEFAULT_MAX_BYTES) else "the memory free on rank 0"
        raise ValueError(
            f"{what} would need {per_token * tokens / 2**20:.1f} MiB on rank 0 ({per_token:,} bytes per token: "
            f"captures and logits, times {tokens:,} tokens), over {over} ({limit / 2**20:.1f} MiB), so no prompt ran. "
            "Reduce on the ranks (--reduce mean), stream to files (--to DIR), capture fewer modules or prompts, "
            "or raise --max-mb"
        )


def _free_memory() -> int:
    """Bytes rank 0 can still take for captures (they are kept on the CPU)."""
    import psutil

    return psutil.virtual_memory().available


def _per_prompt(tokenizer, wholes: dict[str, torch.Tensor], logits: torch.Tensor, chunk, inputs: bool) -> list[Trace]:
    """Rank 0 cuts the batch into one `Trace` per prompt, each of its own length (no padding left)."""
    out = []
    for row, tokens in enumerate(chunk):
        n = len(tokens)
        token_ids = tokens.tolist()
        out.append(
            Trace(
                {name: t[row : row + 1, :n].cpu().clone() for name, t in wholes.items()},
                token_ids=token_ids,
                tokens=[tokenizer.decode([i]) for i in token_ids],
                logits=logits[row, :n].float().cpu().clone(),
                inputs=inputs,
            )
        )
    return out


def _write(out_dir: Path, start: int, traces: list[Trace]) -> str:
    """One safetensors file per batch: `{prompt index}/{module}` for captures, `{prompt index}/token_ids`."""
    from safetensors.torch import save_file

    tensors = {}
    for offset, t in enumerate(traces):
        index = start + offset
        for name, tensor in t.items():
            tensors[f"{index}/{name}"] = tensor[0].contiguous()
        tensors[f"{index}/token_ids"] = torch.tensor(t.token_ids)
    path = out_dir / f"captures-{start:08d}.safetensors"
    save_file(tensors, str(path))
    return str(path)


def load_captures(directory: str | Path) -> dict[int, dict[str, torch.Tensor]]:
    """What `--to DIR` wrote: prompt index -> {module: [tokens, ...], "token_ids": [tokens]}."""
    from safetensors.torch import load_file

    out: dict[int, dict[str, torch.Tensor]] = {}
    for path in sorted(Path(directory).glob("captures-*.safetensors")):
        for key, tensor in load_file(str(path)).items():
            index, _, name = key.partition("/")
            out.setdefault(int(index), {})[name] = tensor
    return dict(sorted(out.items()))


def _any_rank_stopped(stop_event: threading.Event | None, device: torch.device) -> bool:
    """Whether any rank was interrupted (one all-reduce, so every rank stops after the same batch)."""
    flag = torch.tensor([1 if stop_event is not None and stop_event.is_set() else 0], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


def _progress(total: int, show: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="trace", unit="prompt", disable=not show, file=sys.stderr)


class _Reducer:
    """Running sums (float64), squares and maxima of each capture over real tokens, on this rank's piece."""

    def __init__(self, op: str, per_prompt: bool, prompts: int, project: torch.Tensor | None):
        self.op, self.per_prompt, self.project = op, per_prompt, project
        self.counts = torch.zeros(prompts, dtype=torch.long)
        self.sums: dict[str, torch.Tensor] = {}
        self.squares: dict[str, torch.Tensor] = {}
        self.maxima: dict[str, torch.Tensor] = {}

    def add(self, local: dict[str, torch.Tensor], splits: dict, mask: torch.Tensor, start: int | None) -> None:
        """Fold one batch in; `start` None for a rank's filler forward, which adds nothing but the entries."""
        rows = range(start, start + mask.shape[0]) if start is not None else range(0)
        if start is not None:
            self.counts[rows.start : rows.stop] = mask.sum(dim=1).cpu()
        for name, x in local.items():
            split = splits[name]
            if self.project is not None:
                if split is not None:
                    x = all_gather_whole(x, split)
                x = x.flatten(2) @ self.project.to(x.device, x.dtype)
            weight = mask.view(*mask.shape, *([1] * (x.dim() - 2))).to(torch.float64)
            xd = x.to(torch.float64)
            if self.op == "max":
                filled = x.float().masked_fill(weight == 0, float("-inf")).amax(dim=1)
                self._keep(self.maxima, name, filled, rows, torch.maximum)
            else:
                self._keep(self.sums, name, (xd * weight).sum(dim=1), rows, torch.add)
                if self.op == "var":
                    self._keep(self.squares, name, (xd * xd * weight).sum(dim=1), rows, torch.add)

    def _keep(self, into: dict, name: str, per_row: torch.Tensor, rows: range, combine) -> None:
        """Fold one batch's per-prompt values in: kept per prompt, or combined over prompts."""
        if self.per_prompt:
            if name not in into:
                empty = float("-inf") if combine is torch.maximum else 0.0
                into[name] = per_row.new_full((len(self.counts), *per_row.shape[1:]), empty)
            into[name][rows.start : rows.stop] = per_row[: len(rows)]
            return
        batch = per_row.amax(dim=0) if combine is torch.maximum else per_row.sum(dim=0)
        into[name] = batch if name not in into else combine(into[name], batch)

    def combine_ranks(self, world: int, names: list[str], model: nn.Module) -> int:
        """When the ranks ran different prompts: every rank gets the sums (maxima) over all of them; the bytes that
        reached rank 0. A module that ran on some ranks' prompts only is refused on every rank."""
        if world == 1:
            return 0
        everyone: list[list[str] | None] = [None] * world
        dist.all_gather_object(everyone, names)
        if any(theirs != names for theirs in everyone):
            odd = sorted(set().union(*everyone) - set.intersection(*(set(n) for n in everyone)))
            raise ValueError(
                f"{odd} ran on some ranks' prompts only (the ranks split the prompts under this layout): reduce them "
                "under decode: tp, or capture modules that every prompt runs through"
            )
        device = next(model.parameters()).device
        total, most = dist.ReduceOp.SUM, dist.ReduceOp.MAX
        parts = [(self.counts, total)]
        for kept, op in ((self.sums, total), (self.squares, total), (self.maxima, most)):
            parts += [(kept[name], op) for name in names if kept]
        sent = 0
        for tensor, op in parts:
            moved = tensor.to(device)
            dist.all_reduce(moved, op=op)
            tensor.copy_(moved)
            sent += tensor.numel() * tensor.element_size() * (world - 1)
        return sent

    def finish(self, splits: dict, done: int) -> tuple[dict[str, torch.Tensor], int]:
        """The reduced tensors, whole on rank 0 (split ones gathered: the only bytes that move), and those bytes."""
        counts = self.counts[:done].to(torch.float64)
        values, sent = {}, 0
        source = self.maxima if self.op == "max" else self.sums
        for name, total in source.items():
            if self.per_prompt:
                total = total[:done]
                count = counts.view(-1, *([1] * (total.dim() - 1))).to(total.device)
            else:
                count = counts.sum()
            if self.op == "mean":
                value = total / count
            elif self.op == "var":
                squares = self.squares[name][:done] if self.per_prompt else self.squares[name]
                mean = total / count
                value = (squares / count - mean * mean).clamp_min(0)
            else:
                value = total
            value = value.to(torch.float32)
            split = None if self.project is not None else splits.get(name)
            whole, nbytes = _to_rank0(value.contiguous(), split)
            values[name], sent = whole, sent + nbytes
        return values, sent
