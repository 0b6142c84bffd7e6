"""Replacing the model a rank holds: the old one is lost only when memory leaves no choice, and the user is told.

Every rank runs `replace_model` for `%load_sharded`. The new checkpoint is checked first on
every rank (`preflight`), so a bad path or a damaged file fails with the old model untouched.
Then, when every rank can hold both models, the new one is loaded beside the old one and they
are swapped only once it has loaded: a failed or interrupted load keeps the old model too.
When memory forces freeing the old model first, rank 0 says so before and after freeing it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import gc
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from shardbook.rankd.loading.load_sharded import LoadedModel, Progress, free_model, load_sharded
from shardbook.rankd.loading.preflight import CheckedCheckpoint, check_checkpoint
from shardbook.rankd.parallel import layout

Notice = Callable[[str], None]
"""Shows one line to the user; `replace_model` calls it on rank 0 only."""


def replace_model(
    ctx: Any,
    config: Any,
    *,
    device: torch.device | str,
    model_path: str | Path | None,
    progress: Progress,
    notice: Notice,
) -> LoadedModel:
    """Load `config`'s model in place of the one in `ctx.state["loaded"]` (and `model`, `tokenizer` in the shell)."""
    device = torch.device(device)
    namespace, speaks = ctx.shell.user_ns, ctx.world.rank == 0
    kept = describe(ctx.state["loaded"]) if "loaded" in ctx.state else None  # the old model, while it is kept
    try:
        checked = check_checkpoint(config, device=device, model_path=model_path, stop=ctx.stop_event)
        if kept is not None and checked.fits_beside:  # free what a reply left gathered; the shards stay
            layout.reshard_model(ctx.state["loaded"].model)
        elif kept is not None:
            _free_first(ctx, kept, checked, device, notice if speaks else None)
            kept = None
        loaded = load_sharded(
            config,
            device=device,
            model_path=model_path,
            progress=progress,
            stop=ctx.stop_event,
            checkpoint=checked.checkpoint,
        )
    except BaseException:
        if kept is not None and speaks:
            notice(f"{kept} is still loaded: `model` and `tokenizer` are unchanged")
        raise
    ctx.state.pop("loaded", None)
    free_model(namespace, device=device)
    namespace["model"], namespace["tokenizer"] = loaded.model, loaded.tokenizer
    ctx.state.update(loaded=loaded, config=config)
    return_freed_memory()
    return loaded


def return_freed_memory() -> None:
    """Collect the old model's cycles and give glibc's freed heap back to the system (`malloc_trim`).

    Once a model has generated, freeing it left ~0.5 GB per reload in rank 0's heap (freed but
    kept by malloc); trimming returns it. Only where glibc provides `malloc_trim`.
    """
    gc.collect()
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


@functools.cache
def _malloc_trim():
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return libc.malloc_trim
    except (OSError, AttributeError):
        return None


def _free_first(ctx: Any, what: str, checked: CheckedCheckpoint, device: torch.device, notice: Notice | None) -> None:
    """Free the old model before loading, saying so (rank 0) before and after."""
    if notice is not None:
        notice(
            f"freeing {what} before loading {checked.path}: the new model cannot be loaded beside it "
            f"({checked.memory_reason}). If this load fails, no model will be loaded."
        )
    ctx.state.pop("loaded")
    free_model(ctx.shell.user_ns, device=device)
    if notice is not None:
        _, now = layout.gather_fits(checked.full_param_bytes, device)
        notice(f"freed {what}; now {now}; loading the new model")


def describe(loaded: LoadedModel) -> str:
    """`the loaded model (LlamaForCausalLM from /path)`."""
    summary = loaded.summary
    return f"the loaded model ({summary['architecture']} from {summary['model_path']})"
