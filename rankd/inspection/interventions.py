"""Interventions: a user's function applied to a module's output (or input) on every rank, in every forward.

The function reaches every rank as code the user already runs there: it is defined in an
``%%all`` cell, so each rank's namespace holds it, and rank 0 registers it *by name* over the
signed control plane. Nothing is unpickled or evaluated from the network: a rank only looks a
name up in its own namespace. Registration is all-or-nothing (an all-reduce of every rank's
verdict), so no rank ever runs a hook the others lack.

The function always sees the whole tensor, as under one process: under `tp`, a split tensor is
all-gathered in the group before the call and each rank keeps its own piece of the result. The
gather happens on every rank in every forward, whether or not the function then fails, so
collectives stay in step, including the extra forwards `synced_gpus` runs on ranks that finished.
A function that the stop button interrupts (KeyboardInterrupt raised inside it, see
:mod:`..control.user_calls`) or that raises is skipped for the rest of that command on that rank, and the command
then fails on that rank naming the function, the module and the cause.

In the continuous batch the functions apply to some rows only: a notebook cell's, not an HTTP client's. Each
forward of a batch step names those rows (``intervention_state.applied_to``, from the step's plan, so every rank
selects alike); the function is called on their slice alone, cut to the columns where they have real tokens, and
its result is put back into those rows; the other rows pass untouched, and a forward with no such row calls
nothing and gathers nothing. One cell's reply thus gives the function what the single-reply path gives it:
[1, tokens, ...]. Under the batch a failure is the step's (``intervention_state.take_failure``): every rank learns
of it and the rows it applied to fail.
"""

from __future__ import annotations

import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardbook.rankd.control import user_calls
from shardbook.rankd.generation.intervention_state import Intervention, Rows, registry, row_selection, take_failure
from shardbook.rankd.parallel.wholes import FeatureSplit, activation_split, all_gather_whole, local_part


class InterventionError(RuntimeError):
    """A registered intervention function raised on this rank."""


def add(model: nn.Module, namespace: dict[str, Any], name: str, modules: list[str], on_input: bool) -> Intervention:
    """Register `namespace[name]` on `modules` on every rank, or on none (a collective)."""
    problem = _why_not(namespace, name)
    agree(problem, model)
    remove(model, name)
    fn = namespace[name]
    iv = Intervention(name, modules, on_input)
    selected = row_selection(model)
    for module_name in modules:
        apply = _applier(iv, fn, module_name, activation_split(model, module_name, on_input), selected)
        module = model.get_submodule(module_name)
        if on_input:
            iv.handles.append(module.register_forward_pre_hook(_input_hook(apply), with_kwargs=True))
        else:
            iv.handles.append(module.register_forward_hook(_output_hook(apply)))
    registry(model)[name] = iv
    return iv


def remove(model: nn.Module, name: str | None) -> list[str]:
    """Remove one intervention by name (None: all of them); the names removed."""
    found = registry(model)
    names = list(found) if name is None else [name] if name in found else []
    for key in names:
        for handle in found.pop(key).handles:
            handle.remove()
    return names


def raise_failures(model: nn.Module) -> None:
    """Raise the first failure of any intervention since the last call (and forget them)."""
    text = take_failure(model)
    if text is not None:
        raise InterventionError(text)


def agreed_function(model: nn.Module, namespace: dict[str, Any], name: str, example: str) -> Callable:
    """The function `name` from this rank's namespace, once every rank has found one (else every rank raises)."""
    problem = _why_not(namespace, name, example)
    agree(problem, model)
    return namespace[name]


def _why_not(
    namespace: dict[str, Any], name: str, example: str = "(output, module_name):\n    return output * 0"
) -> str | None:
    fn = namespace.get(name)
    if fn is None:
        return (
            f"no function named {name!r} in this rank's namespace: define it in an %%all cell first, so that every "
            f"rank has it, e.g.\n%%all\ndef {name}{example}"
        )
    if not callable(fn):
        return f"{name!r} is a {type(fn).__name__}, not a function: give the name of a function defined in %%all"
    return None


def agree(problem: str | None, model: nn.Module) -> None:
    """Every rank learns whether all of them can register; each raises its own reason, or the others' absence."""
    failed = torch.tensor([0 if problem is None else 1], device=next(model.parameters()).device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(failed)
    if problem is not None:
        raise ValueError(problem)
    if failed.item():
        raise ValueError(
            f"not registered on rank {dist.get_rank()}: another rank could not register it (see its error)"
        )


def _call(iv: Intervention, fn: Callable, module_name: str, whole: torch.Tensor) -> torch.Tensor:
    """`fn`'s result for `whole` (whole itself when it returns None or after a failure), never raising."""
    if iv.failure is not None:
        return whole
    rank = dist.get_rank() if dist.is_initialized() else 0
    started = time.monotonic()
    try:
        result = user_calls.call(lambda: _run_user_function(iv, fn, module_name, whole))
        result = whole if result is None else result
        if not isinstance(result, torch.Tensor) or result.shape != whole.shape:
            got = tuple(result.shape) if isinstance(result, torch.Tensor) else type(result).__name__
            raise ValueError(f"it returned {got}; return a tensor of shape {tuple(whole.shape)}, or None")
        return result.to(whole.dtype)
    except KeyboardInterrupt:  # the stop button reached the function (see user_calls): the forward goes on
        iv.failure = (
            f"intervention {iv.name!r} was interrupted on rank {rank} at {module_name} after "
            f"{time.monotonic() - started:.1f} s in the function. It was skipped there for the rest of this "
            f"command; fix it in %%all and register it again, or remove it (%intervene --remove {iv.name})."
        )
        return whole
    except Exception as e:
        where = "".join(traceback.format_exception(e)[-3:])
        iv.failure = (
            f"intervention {iv.name!r} raised on rank {rank} at {module_name}: {type(e).__name__}: {e}. It was "
            f"skipped there for the rest of this command; fix it in %%all and register it again, or remove it "
            f"(%intervene --remove {iv.name}).\n{where}"
        )
        return whole


def _run_user_function(iv: Intervention, fn: Callable, module_name: str, whole: torch.Tensor) -> Any:
    with user_calls.user_call(f"intervention {iv.name!r} at {module_name}"):
        return fn(whole, module_name)


def _whole_then_back(
    iv: Intervention, fn: Callable, module_name: str, split: FeatureSplit | None, local: torch.Tensor
) -> torch.Tensor:
    if split is None:
        return _call(iv, fn, module_name, local)
    whole = all_gather_whole(local, split)  # on every rank, failed or not: the group stays in step
    return local_part(_call(iv, fn, module_name, whole), split)


def _applier(
    iv: Intervention, fn: Callable, module_name: str, split: FeatureSplit | None, selected: list[Rows | None]
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The hooks' work on one tensor: `fn` on every row, or on the selected rows' slice only (see the module)."""

    def apply(local: torch.Tensor) -> torch.Tensor:
        rows = selected[0]
        if rows is None:
            return _whole_then_back(iv, fn, module_name, split, local)
        if not rows.rows:
            return local
        cut = _row_slice(local, rows)
        if cut is None:  # alike on every rank (same shapes, same plan): nothing is gathered anywhere
            if iv.failure is None:
                iv.failure = (
                    f"intervention {iv.name!r} cannot apply to some rows of the batch at {module_name}: its "
                    f"{'input' if iv.on_input else 'output'} there has shape {tuple(local.shape)}, not [rows, "
                    f"tokens, ...] of a forward of {rows.batch} rows of {rows.tokens} tokens. Intervene on a module "
                    "whose tensor has a row per sequence, or reply alone (%%chat --no-batch)."
                )
            return local
        picked, put_back = cut
        return put_back(_whole_then_back(iv, fn, module_name, split, picked))

    return apply


def _row_slice(local: torch.Tensor, rows: Rows):
    """`rows`' slice of `local` [batch, tokens, ...] (or its tokens flattened: [batch * tokens, ...]), and how to put a
    result of that shape back into a copy of `local`; None when `local` has neither layout."""
    index = torch.tensor(rows.rows, device=local.device)
    flat = local.dim() >= 2 and local.shape[0] == rows.batch * rows.tokens and rows.tokens > 1
    view = local.unflatten(0, (rows.batch, rows.tokens)) if flat else local
    if view.dim() < 2 or view.shape[0] != rows.batch:
        return None
    columns = slice(rows.start, None) if view.shape[1] == rows.tokens else slice(None)
    picked = view[index, columns]

    def put_back(result: torch.Tensor) -> torch.Tensor:
        out = view.clone()
        out[index, columns] = (result.unflatten(0, (len(rows.rows), -1)) if flat else result).to(out.dtype)
        return out.flatten(0, 1) if flat else out

    return (picked.flatten(0, 1) if flat else picked), put_back


def _output_hook(apply: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module: nn.Module, args: tuple, output: Any) -> Any:
        if isinstance(output, tuple):
            return (apply(output[0]), *output[1:])
        return apply(output)

    return hook


def _input_hook(apply: Callable[[torch.Tensor], torch.Tensor]):
    def hook(module: nn.Module, args: tuple, kwargs: dict[str, Any]) -> Any:
        if args:
            return (apply(args[0]), *args[1:]), kwargs
        key = "hidden_states" if "hidden_states" in kwargs else next(iter(kwargs))
        return args, {**kwargs, key: apply(kwargs[key])}

    return hook
