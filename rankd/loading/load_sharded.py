"""Sharded loading (`%load_sharded`): every rank builds a meta skeleton, shards it with FSDP2, reads only its slices.

`load_sharded` runs identically on every rank of an initialised process group. The steps are
config -> skeleton (on the meta device) -> shard (FSDP2 per decoder layer, then the root) ->
read (each rank maps the safetensors files and takes only its rows onto its device, see
`weight_reading`) -> finalise (non-persistent buffers, tied weights, eval).
No rank ever holds a full copy of the weights while loading.

Failures: a step that fails on one rank makes every rank raise a `ValueError` at the next sync
point (see `load_steps`), so no rank is left waiting in a collective. The failing rank raises
its own error (with the cause chained); the others name it.
Before loading again, every rank calls `free_model` on the namespace that holds the old model.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import socket
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from shardbook.rankd.loading.fp8_keep import FP8Keeping, fp8_keeping, require_keep_layout
from shardbook.rankd.loading.load_steps import LoadSteps
from shardbook.rankd.loading.summary import (
    checkpoint_figures,
    fp8_figures,
    full_param_bytes,
    kv_cache_figures,
    load_summary,
    rank_figures,
    tp_figures,
)
from shardbook.rankd.loading.weight_reading import plan_reads, read_shards, read_tp_slices
from shardbook.rankd.parallel.expert_parallel import ExpertLayout, expert_layout_problem, num_experts
from shardbook.rankd.parallel.fastest_dtype import fastest_dtype
from shardbook.rankd.parallel.layout import (
    apply_fsdp,
    choose_layout,
    expert_group,
    free_memory_per_rank,
    fsdp_mesh_layout,
    gather_fits,
    init_mesh,
    reshard_model,
)
from shardbook.rankd.parallel.packed_linear import pack_linears
from shardbook.rankd.parallel.tensor_parallel import shard_tp, tp_unavailable

log = logging.getLogger(__name__)

Progress = Callable[[str, int, int], None]
"""`progress(step, done, total)`; steps in order: config, skeleton, shard, read, finalise."""

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """What `load_sharded` returns on every rank."""

    model: nn.Module
    """The FSDP2-sharded causal LM, in eval mode, on this rank's device."""
    tokenizer: Any
    """The checkpoint's tokenizer (every rank has its own)."""
    summary: dict[str, Any]
    """Architecture, sizes, mesh, per-rank memory, load time and the decode layout with its reason."""


@dataclass
class _Checkpoint:
    """What the config step learned, identical on every rank."""

    path: Path
    hf_config: Any
    dtype: torch.dtype
    tokenizer: Any
    generation_config: Any
    mesh_shape: tuple[int, ...]
    mesh_axes: tuple[str, ...]
    trust_remote_code: bool
    fp8: FP8Keeping | None = None
    """How FP8 block weights are kept (`model.fp8_weights`); None: dequantized."""
    fp8_note: str = ""
    """What `model.fp8_weights` came to, for the summary ('' for the default)."""


def load_sharded(
    config: Any,
    *,
    device: torch.device | str,
    model_path: str | Path | None = None,
    progress: Progress | None = None,
    stop: threading.Event | None = None,
    checkpoint: Any = None,
) -> LoadedModel:
    """Load `config.model` sharded over the ranks as `config.parallel` says; call on every rank.

    `config` has `model.{model_name_or_path, dtype, trust_remote_code}` and
    `parallel.{fsdp_size, ep_size, ep_fsdp_size, decode}` (a `ShardbookConfig` or any object
    shaped like it). `model_path` is the resolved checkpoint directory (rank 0 resolves demo
    names and sends the path); without it `config.model.model_name_or_path` is used as a path.
    `stop`, once set, makes every rank stop at its next safe point and raise KeyboardInterrupt.
    `checkpoint` is what `preflight.check_checkpoint` already read (config, tokenizer): it is reused.
    """
    if not dist.is_initialized():
        raise ValueError("load_sharded needs a torch.distributed process group: call rankd.world.init_world() first")
    try:
        with gc_paused():
            return _load(config, torch.device(device), model_path, _Reporter(progress), stop, checkpoint)
    except BaseException as e:
        # A notebook keeps the last traceback: its frames must not pin a half-loaded model.
        _drop_frame_locals(e)
        raise


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Hold off the cyclic garbage collector while loading.

    The tokenizer's JSON and the module tree are hundreds of thousands of new objects; each batch
    of them sets off a collection that walks every object the kernel holds, which doubled the
    config step (0.13 -> 0.31 s with SmolLM2 in a process that had loaded once before).
    """
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _load(
    config: Any,
    device: torch.device,
    model_path: str | Path | None,
    report: _Reporter,
    stop: threading.Event | None,
    checkpoint: _Checkpoint | None,
) -> LoadedModel:
    """The steps of `load_sharded`, in order, settled with every rank after the skeleton and after the read."""
    started = time.perf_counter()
    steps = LoadSteps(stop)
    ckpt = checkpoint if checkpoint is not None else steps.run("config", read_checkpoint, config, model_path, device)
    if steps.ok:
        report("config", 1, 1)
    model = steps.run("skeleton", build_skeleton, ckpt)
    if steps.ok:
        report("skeleton", 1, 1)
    architecture = type(model).__name__  # fully_shard renames the class to FSDP<name>
    views = steps.settle(steps.run("memory", _memory_view, model, device))
    layout, reason, ep_sizes = _decide_layout(config.parallel, ckpt, views)
    mesh = init_mesh(device.type, ckpt.mesh_shape, ckpt.mesh_axes)
    if layout == "tp":
        targets, experts = _shard_and_read_tp(steps, report, model, mesh, ckpt, device, ep_sizes)
        reason += experts
    else:
        steps.run("shard", apply_fsdp, model, mesh, layout == "reshard", steps.progress(report, "shard"))
        targets = steps.run("plan", plan_reads, model, ckpt.path)
        steps.run("read", read_shards, model, targets, device, steps.progress(report, "read"))
    steps.run("finalise", _finalise, model, ckpt, device)
    if steps.ok:
        report("finalise", 1, 1)
    every = steps.settle(rank_figures(model, device, time.perf_counter() - started) if steps.ok else None)
    summary = load_summary(
        model,
        every,
        architecture=architecture,
        path=str(ckpt.path),
        mesh=mesh,
        device=device,
        decode=layout,
        decode_reason=reason,
    )
    if steps.ok:
        summary.update(checkpoint_figures(targets), **fp8_figures(model, ckpt.fp8_note))
    if layout == "tp" and steps.ok:
        summary.update(tp_figures(model, ckpt.mesh_shape[-1]))
    if layout == "gather" and steps.ok:  # every rank settled above: the warm-up's collectives line up
        report("warm-up", 0, 1)
        summary["warm_up_s"] = steps.run("warm-up", warm_up, model, ckpt, device)
    if layout != "reshard":  # reshard gathers every layer anew for each forward: a packed copy would not last
        steps.run("pack", pack_linears, model)
    free = steps.settle(free_memory_per_rank(device))  # after the warm-up and the packing, which hold memory
    if layout == "gather":
        report("warm-up", 1, 1)
    summary.update(kv_cache_figures(model, free, ckpt.mesh_shape[-1] if layout == "tp" else None))
    return LoadedModel(model=model, tokenizer=ckpt.tokenizer, summary=summary)


def _decide_layout(parallel: Any, ckpt: _Checkpoint, views: list) -> tuple[str, str, tuple[int, int]]:
    """The forward layout, why, and (ep_size, ep_fsdp_size): the same on every rank (no collective).

    Expert parallelism (ep_size x ep_fsdp_size > 1) runs in `tp`, so it makes `auto` mean `tp`.
    """
    parts = ckpt.mesh_shape[-1]
    ep_sizes = (parallel.ep_size, parallel.ep_fsdp_size)
    tp_reason = tp_unavailable(ckpt.hf_config, parts) or expert_layout_problem(ckpt.hf_config, parts, *ep_sizes)
    experts_on = ep_sizes[0] * ep_sizes[1] > 1
    fp8_kept = ckpt.fp8 is not None
    requested = "tp" if parallel.decode == "auto" and (experts_on or fp8_kept) else parallel.decode
    require_keep_layout(ckpt.fp8, requested, tp_reason)
    layout, reason = choose_layout(requested, views, tp_reason)
    if requested != parallel.decode:
        reason = (
            f"parallel.ep_size x ep_fsdp_size = {ep_sizes[0] * ep_sizes[1]}: expert parallelism runs in the tp layout"
            if experts_on
            else "model.fp8_weights keeps FP8 weights, which the tp layout holds"
        )
    return layout, reason, ep_sizes


def check_layout(parallel: Any, ckpt: _Checkpoint) -> None:
    """Raise the `ValueError` the layout choice would raise for this request (tp availability, expert sizes).

    The preflight runs it before anything is freed: only memory decides between valid layouts, so
    whether the request is valid does not depend on the memory views.
    """
    _decide_layout(parallel, ckpt, [(True, "")])


def _shard_and_read_tp(
    steps: LoadSteps, report: _Reporter, model: nn.Module, mesh, ckpt: _Checkpoint, device, ep_sizes
) -> tuple[dict, str]:
    """The `tp` layout's shard and read steps: slice the layers, then read each rank's pieces of every weight.

    Returns the read plan and what the reason should add about the experts (empty for a dense model).
    """
    experts, experts_group = None, None
    if num_experts(ckpt.hf_config.get_text_config()):
        experts = ExpertLayout.of(ckpt.mesh_shape[-1], *ep_sizes)
        # a collective over the world (outside any step: every rank gets here, failed step or not)
        experts_group = expert_group(device.type, experts.set_size, experts.parts, mesh.get_group("shard"))
    targets = steps.run("plan", plan_reads, model, ckpt.path)  # on the global shapes, before slicing
    plan = steps.run("shard", shard_tp, model, mesh, experts, experts_group)
    if steps.ok:
        report("shard", 1, 1)
    rank = mesh.get_local_rank("shard")
    read_progress = steps.progress(report, "read")
    steps.run("read", read_tp_slices, model, targets, plan, rank, device, read_progress, ckpt.fp8)
    return targets, f"; {experts.describe()}" if experts is not None else ""


def _memory_view(model: nn.Module, device: torch.device) -> tuple[bool, str]:
    """Whether the gathered model fits this rank's memory, and why (for the layout choice)."""
    return gather_fits(full_param_bytes(model), device)


def free_model(
    namespace: dict[str, Any], *, device: torch.device | str, names: tuple[str, ...] = ("model", "tokenizer")
) -> None:
    """Remove `names` from `namespace` and return the model's memory; call on every rank before loading again.

    The gathered weights that `reshard_after_forward=False` keeps after a forward are freed at
    once, even if something else (IPython's `Out`, a user variable) still holds the model; its
    shards are freed as soon as nothing does.
    """
    released = [namespace.pop(name) for name in names if name in namespace]
    for obj in released:
        if isinstance(obj, nn.Module):
            reshard_model(obj)
    del released
    gc.collect()
    device = torch.device(device)
    if device.type != "cpu":
        getattr(torch, device.type).empty_cache()


def _drop_frame_locals(error: BaseException | None) -> None:
    """Clear the local variables of the finished frames in `error`'s traceback and in its causes."""
    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        traceback.clear_frames(error.__traceback__)
        error = error.__cause__ or error.__context__


class _Reporter:
    """Calls the user's progress callback; one that raises is disabled, never left to desynchronise the ranks."""

    def __init__(self, progress: Progress | None):
        self.progress = progress

    def __call__(self, step: str, done: int, total: int) -> None:
        if self.progress is None:
            return
        try:
            self.progress(step, done, total)
        except Exception as e:  # a broken progress bar on one rank must not stop it halfway through the load
            log.warning("progress callback failed (%s: %s); loading continues without it", type(e).__name__, e)
            self.progress = None


def read_checkpoint(config: Any, model_path: str | Path | None, device: torch.device) -> _Checkpoint:
    """Validate the request and read the checkpoint's config, tokenizer and generation config."""
    from transformers import AutoConfig, AutoTokenizer

    mesh_shape, mesh_axes = fsdp_mesh_layout(config.parallel.fsdp_size, dist.get_world_size())
    path = _checkpoint_dir(model_path if model_path is not None else config.model.model_name_or_path)
    trust = bool(config.model.trust_remote_code)
    hf_config = AutoConfig.from_pretrained(path, trust_remote_code=trust)
    _require_causal_lm(hf_config, path)
    fp8, fp8_note = fp8_keeping(getattr(config.model, "fp8_weights", "dequantize"), hf_config, device)
    return _Checkpoint(
        path=path,
        hf_config=hf_config,
        dtype=_resolve_dtype(config.model.dtype, hf_config, device),
        tokenizer=_with_chat_template(
            AutoTokenizer.from_pretrained(path, trust_remote_code=trust), getattr(config.model, "chat_template", None)
        ),
        generation_config=_generation_config(path, hf_config),
        mesh_shape=mesh_shape,
        mesh_axes=mesh_axes,
        trust_remote_code=trust,
        fp8=fp8,
        fp8_note=fp8_note,
    )


def _with_chat_template(tokenizer: Any, template_file: str | None) -> Any:
    """The tokenizer with ``model.chat_template``'s file as its chat template (None: its own), read on this rank's
    file system (each node has its own), so every rank renders prompts alike."""
    if template_file is None:
        return tokenizer
    path = Path(template_file).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) else "not UTF-8 text"
        raise ValueError(
            f"model.chat_template: cannot read {path} on {socket.gethostname()} ({reason}): give the path of a "
            "Jinja chat template file that every node can read (absolute, or relative to where the ranks run), "
            "or null to keep the tokenizer's own"
        ) from None
    if not text.strip():
        raise ValueError(f"model.chat_template: {path} is empty: write a Jinja chat template in it, or set null")
    tokenizer.chat_template = text
    return tokenizer


def _checkpoint_dir(name_or_path: str | Path) -> Path:
    """The checkpoint directory, checked on this rank's file system (each node has its own)."""
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(
            f"{path} is not a checkpoint directory on {socket.gethostname()} (no config.json there): give a local "
            "Hugging Face checkpoint directory that every node can read, or a demo name such as "
            "smollm2-135m-instruct (`shardbook fetch` builds it)"
        )
    if not any(path.glob("*.safetensors")):
        raise ValueError(
            f"{path} has no *.safetensors files on {socket.gethostname()}; sharded loading reads safetensors only: "
            "convert the checkpoint (load it once with transformers and save_pretrained it)"
        )
    return path


def _require_causal_lm(hf_config: Any, path: Path) -> None:
    """Refuse checkpoints whose saved architecture is not a causal language model."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    causal = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values())
    architectures = list(getattr(hf_config, "architectures", None) or [])
    remote = "AutoModelForCausalLM" in (getattr(hf_config, "auto_map", None) or {})
    if remote or any(name in causal or name.endswith("ForCausalLM") for name in architectures):
        return
    saved = ", ".join(architectures) or f"a {hf_config.model_type} model with no saved architecture"
    raise ValueError(
        f"{path} holds {saved}, not a causal language model: %load_sharded loads models for text "
        "generation (e.g. LlamaForCausalLM, Qwen2ForCausalLM); pick such a checkpoint"
    )


def _resolve_dtype(name: str, hf_config: Any, device: torch.device) -> torch.dtype:
    """The weight dtype: `auto` means the checkpoint's own, `fastest` the device's (`fastest_dtype`); it must be
    one this device can compute in."""
    if name == "fastest":
        name = str(fastest_dtype(device)).removeprefix("torch.")
    if name == "auto":
        saved = getattr(hf_config, "dtype", None) or torch.float32
        name = str(saved).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(
            f"dtype {name!r} is not supported for loading: set model.dtype to one of auto, fastest, {', '.join(DTYPES)}"
        )
    dtype = DTYPES[name]
    try:
        probe = torch.ones(4, 4, dtype=dtype, device=device)
        torch.softmax(probe @ probe, dim=-1)
    except (RuntimeError, TypeError) as e:
        raise ValueError(f"{device} cannot compute in {name} ({e}): set model.dtype to float32") from e
    return dtype


def _generation_config(path: Path, hf_config: Any) -> Any:
    """The checkpoint's generation_config.json (eos, defaults), or one derived from the model config."""
    from transformers import GenerationConfig

    if (path / "generation_config.json").is_file():
        return GenerationConfig.from_pretrained(path)
    return GenerationConfig.from_model_config(hf_config)


def build_skeleton(ckpt: _Checkpoint) -> nn.Module:
    """The model with every parameter and buffer on the meta device: shapes only, no memory."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            ckpt.hf_config, dtype=ckpt.dtype, trust_remote_code=ckpt.trust_remote_code
        )


def _finalise(model: nn.Module, ckpt: _Checkpoint, device: torch.device) -> None:
    """Recreate non-persistent buffers, check tied weights, and set the model up for generation."""
    _recreate_buffers(model, device)
    _require_nothing_on_meta(model)
    if getattr(ckpt.hf_config.get_text_config(), "tie_word_embeddings", False):
        output, input_ = model.get_output_embeddings(), model.get_input_embeddings()
        assert output.weight is input_.weight, "FSDP must keep tied embeddings one parameter"
    model.eval()
    if model.supports_gradient_checkpointing:  # off for generation; named activation_* since transformers 5
        disable = getattr(model, "activation_checkpointing_disable", None) or model.gradient_checkpointing_disable
        disable()
    model.config.use_cache = True
    model.generation_config = ckpt.generation_config


def warm_up(model: nn.Module, ckpt: _Checkpoint, device: torch.device) -> float:
    """One forward of a short input on every rank (a collective); its seconds.

    Under `gather` the first forward all-gathers every layer and keeps them (reshard_after_forward
    is off), and a first forward pays one-off costs (kernels chosen, allocator pools filled): done
    here, inside the load, the first reply's first token comes as fast as the next reply's.
    """
    started = time.perf_counter()
    token = ckpt.tokenizer.bos_token_id
    token = ckpt.tokenizer.eos_token_id if token is None else token
    ids = torch.full((1, 4), 0 if token is None else int(token), dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False)
    return time.perf_counter() - started


def _recreate_buffers(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary `inv_freq`) are in no file: rebuild their module on the device and take them."""
    for name, module in model.named_modules():
        # torch lists a module's non-persistent buffers only in this attribute
        buffers = [b for b in module._non_persistent_buffers_set if getattr(module, b, None) is not None]
        if not buffers:
            continue
        module_config = getattr(module, "config", None)
        if module_config is None:
            raise ValueError(
                f"{name} ({type(module).__name__}) has buffers {buffers} that are not saved in checkpoints "
                "and that sharded loading cannot recompute (it rebuilds modules created from the model config)"
            )
        with torch.device(device):
            fresh = type(module)(module_config)
        for buffer in buffers:
            setattr(module, buffer, getattr(fresh, buffer))


def _require_nothing_on_meta(model: nn.Module) -> None:
    """Every parameter and buffer came from the files or was recomputed; one still on meta would fail in forward."""
    left = [name for name, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if left:
        raise ValueError(
            f"{len(left)} tensor(s) are neither in the checkpoint nor recomputed when loading, e.g. {left[:3]}: "
            "sharded loading supports models whose every parameter and persistent buffer is saved in the files"
        )
