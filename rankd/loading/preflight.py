"""Checks of a checkpoint that every rank makes, and agrees on, before the model loaded now is touched.

A load replaces the model a rank holds; a typo in a path or a damaged file must not cost that
model (for a large one, an hour of loading). Everything that can be checked without reading
weights is checked here, on every rank's own file system (each node has its own): the request
(mesh, dtype, the layout: `tp` availability and expert sizes), `config.json` (readable, a known
`model_type`, a causal LM), the tokenizer, the safetensors index and every file's header, and the
shape of every stored tensor against a skeleton of the model built from the config on the meta
device (no memory). The ranks settle once, so when any rank finds a problem every rank raises the
same way and nothing has been freed.

The check also says whether the new model can be loaded beside the old one: when its gathered
weights take at most half of the memory free on every rank (the rule that lets a load keep
layers gathered, `layout.gather_fits`), keeping the old model meanwhile changes neither the
new model's layout nor whether it fits. Otherwise the old model must be freed first.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardbook.rankd.loading.load_sharded import build_skeleton, check_layout, gc_paused, read_checkpoint
from shardbook.rankd.loading.load_steps import LoadSteps
from shardbook.rankd.loading.summary import full_param_bytes
from shardbook.rankd.loading.weight_reading import plan_reads
from shardbook.rankd.parallel import layout


@dataclass(frozen=True)
class CheckedCheckpoint:
    """What every rank learned from a checkpoint that passed the checks (the same on every rank)."""

    path: Path
    """The checkpoint directory."""
    full_param_bytes: int
    """Bytes of the new model's parameters, unsharded."""
    fits_beside: bool
    """Every rank can hold the new model while it still holds the one loaded now."""
    memory_reason: str
    """Why it fits or not: the first rank where it does not, else rank 0's view."""
    checkpoint: Any
    """The config, tokenizer and generation config as read here, for the load to reuse."""


def check_checkpoint(
    config: Any, *, device: torch.device, model_path: str | Path | None = None, stop: threading.Event | None = None
) -> CheckedCheckpoint:
    """Check the checkpoint `config` names on every rank (a collective); raise on every rank if any fails.

    Errors are `ValueError`s naming the cause and the fix, as `loading.load_sharded` raises them;
    `stop`, once set, makes every rank raise KeyboardInterrupt together.
    """
    steps = LoadSteps(stop)
    with gc_paused():
        ckpt = steps.run("config", read_checkpoint, config, model_path, torch.device(device))
        steps.run("layout", check_layout, config.parallel, ckpt)
        model = steps.run("skeleton", build_skeleton, ckpt)
        steps.run("plan", plan_reads, model, ckpt.path if ckpt is not None else None)
        view = steps.run("memory", _memory_view, model, torch.device(device))
        del model  # the skeleton holds no memory, but nothing should keep it past the check
    views = steps.settle(view)
    misfits = [(rank, reason) for rank, (fits, reason, _) in enumerate(views) if not fits]
    rank, reason = misfits[0] if misfits else (0, views[0][1])
    return CheckedCheckpoint(
        path=ckpt.path,
        full_param_bytes=view[2],
        fits_beside=not misfits,
        memory_reason=f"on rank {rank} {reason}",
        checkpoint=ckpt,
    )


def _memory_view(model: nn.Module, device: torch.device) -> tuple[bool, str, int]:
    """Whether this rank can hold the new model's gathered weights in half of its free memory, why, and their size."""
    full = full_param_bytes(model)
    fits, reason = layout.gather_fits(full, device)
    return fits, reason, full
