"""`model.fp8_weights`: whether a load keeps a checkpoint's FP8 block weights as FP8, and reading them so.

- `dequantize` (the default until the FP8 path is measured): every quantized weight is dequantized
  to the compute dtype, as `weight_reading` does for every format.
- `keep`: on a device where torch's blockwise FP8 matmul runs (CUDA; torch 2.13's kernel needs
  compute capability 9.0, and the load checks by running it once), the `tp` layout keeps each
  weight stored as e4m3 blocks with a `weight_scale_inv` as FP8 codes with their scales, at about
  half the weight bytes of bf16: linear layers (`parallel.fp8_linear`) and the routed experts
  fused from per-expert tensors (`parallel.fp8_experts`), with or without `parallel.ep_size`.
  Anywhere else the request is overridden: a warning says why and the weights are dequantized as
  with `dequantize`.
- `keep-reference`: keeps them on any device and computes with the reference path (a piece of the
  weight dequantized at a time): slow, for checking the FP8 path where no kernel runs (the tests).

Only the `tp` layout keeps FP8 weights (FSDP2's `gather` and `reshard` dequantize): with a keeping
choice `auto` means `tp`, and an explicit `gather` or `reshard` is refused. Weights in other
formats (e5m2, MXFP4, INT4) and experts stored already fused or with biases (GPT-OSS's layout)
are dequantized whatever the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardbook.rankd.loading.checkpoint_names import ExpertStack, Selection, select
from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.loading.quantized_formats import quantization_settings
from shardbook.rankd.loading.safetensors_files import MappedFiles
from shardbook.rankd.parallel.expert_parallel import ExpertParallel
from shardbook.rankd.parallel.fp8_experts import EXPERT_WEIGHTS, keep_fp8_experts
from shardbook.rankd.parallel.fp8_linear import KEEPABLE, keep_fp8, kernel_fits, kernel_unavailable

log = logging.getLogger(__name__)

KEEP_LAYOUTS = ("tp",)


@dataclass
class FP8Keeping:
    """A load that keeps FP8 block weights: with torch's kernel where a shard fits it, or by the reference path."""

    kernel: bool
    files: MappedFiles = field(default_factory=MappedFiles)

    def module_of(self, model: nn.Module, names: list[str], stored: Any) -> nn.Module | None:
        """The module that keeps `stored` in FP8, when it is e4m3 blocks that a module here can hold; else None:
        a linear layer for `X.weight`, an expert-parallel experts module for its fused `gate_up_proj` or `down_proj`
        stacked from per-expert e4m3 tensors."""
        if len(names) != 1:
            return None
        module_name, _, leaf = names[0].rpartition(".")
        if isinstance(stored, ExpertStack):
            module = model.get_submodule(module_name)
            kept = leaf in EXPERT_WEIGHTS and isinstance(module, ExpertParallel) and stored.axis == 0
            return module if kept and all(_e4m3_blocks(p) for part in stored.parts for p in part) else None
        if leaf != "weight" or not _e4m3_blocks(stored):
            return None
        module = model.get_submodule(module_name)
        return module if type(module) in KEEPABLE else None

    def keep(
        self, module: nn.Module, name: str, stored: QuantizedTensor | ExpertStack, selection: Selection, device
    ) -> torch.Tensor:
        """Make `module` hold `selection` of `stored` (from `module_of`) in FP8; the e4m3 codes it is to hold."""
        if isinstance(stored, ExpertStack):
            return self._keep_experts(module, name, stored, selection, device)
        codes, scales, lead = self._held(name, stored, selection)
        codes = codes.to(device).contiguous()
        block = stored.block[1]
        keep_fp8(module, scales.to(device), lead, block, self.kernel and kernel_fits(codes, lead, block))
        return codes.view(stored.codes.dtype)

    def _keep_experts(self, module: nn.Module, name: str, stack: ExpertStack, selection: Selection, device):
        """The codes [experts, rows, columns] of the selected experts' slices, each read on its own into its place
        (never a stack of dequantized experts), with their per-row scales given to `module`."""
        experts = stack.experts(selection[0])
        codes = scales = None
        for index, expert in enumerate(experts):
            held = [self._held(name, part, inner) for part, inner in stack.pieces(expert, selection[1:])]
            leads = {lead for _, _, lead in held}
            assert len(leads) == 1, f"{name}: gate and up slices start at different columns"
            if codes is None:
                rows = sum(c.shape[0] for c, _, _ in held)
                codes = torch.empty((len(experts), rows, held[0][0].shape[1]), dtype=torch.uint8, device=device)
                scales = torch.empty((len(experts), rows, held[0][1].shape[1]), device=device)
            codes[index].copy_(torch.cat([c for c, _, _ in held]))
            scales[index].copy_(torch.cat([s for _, s, _ in held]))
        block, lead = stack.parts[0][0].block[1], leads.pop()
        kernel = self.kernel and kernel_fits(codes[0], lead, block)
        keep_fp8_experts(module, name.rpartition(".")[2], scales, lead, block, kernel)
        return codes.view(stack.parts[0][0].codes.dtype)

    def _held(self, name: str, stored: QuantizedTensor, selection: Selection) -> tuple[torch.Tensor, torch.Tensor, int]:
        """`selection` of `stored`'s codes (as bytes, a view of the mapped file where it can be), their per-row
        scales, and how far into its first column block the selection starts."""
        rows, columns = selection
        if columns is not None and len(columns) != 1:
            raise ValueError(
                f"{name} is split into {len(columns)} column ranges on one rank, which model.fp8_weights keep cannot "
                "hold in FP8 (one range of columns per rank): set model.fp8_weights dequantize"
            )
        codes = select(self.files.view(stored.codes).view(torch.uint8), selection)
        scales, lead = _row_scales(stored, self.files, rows, columns[0] if columns else range(stored.values[1]))
        return codes, scales, lead


def _e4m3_blocks(stored: Any) -> bool:
    """An fp8 e4m3 2-D weight with float scales per block or per tensor (transformers' fine-grained FP8)."""
    return (
        isinstance(stored, QuantizedTensor)
        and stored.code == "float"
        and stored.codes.dtype == torch.float8_e4m3fn
        and len(stored.values) == 2
        and stored.order == (0, 1)
        and stored.format.startswith("fp8 e4m3")
    )


def _row_scales(stored: QuantizedTensor, files: MappedFiles, rows, columns: range) -> tuple[torch.Tensor, int]:
    """Per held row, the float32 scale of each column block the columns touch; and how far into the first block
    the columns start."""
    grid = stored.scale_grid(files)
    row_index = (
        torch.arange(stored.values[0]) if rows is None else torch.cat([torch.arange(r.start, r.stop) for r in rows])
    )
    block_rows, block_cols = stored.block
    first, last = columns.start // block_cols, (columns.stop - 1) // block_cols
    scales = grid[row_index // block_rows, first : last + 1].contiguous()
    return scales, columns.start - first * block_cols


def fp8_keeping(requested: str, hf_config: Any, device: torch.device) -> tuple[FP8Keeping | None, str]:
    """What `model.fp8_weights` means for this checkpoint on this device, and a sentence saying so (or '')."""
    if requested == "dequantize":
        return None, ""
    settings = quantization_settings(hf_config) or {}
    if settings.get("quant_method") != "fp8":
        return None, f"model.fp8_weights {requested}: the checkpoint has no FP8 block weights, nothing to keep"
    if requested == "keep-reference":
        return FP8Keeping(kernel=False), "FP8 block weights kept in FP8, computed by the reference path (slow)"
    why = kernel_unavailable(device)
    if why is not None:
        note = f"model.fp8_weights keep: {why}, so the FP8 weights are dequantized (as model.fp8_weights dequantize)"
        log.warning(note)
        return None, note
    return FP8Keeping(kernel=True), "FP8 block weights kept in FP8, computed by torch's blockwise FP8 matmul"


def require_keep_layout(keeping: FP8Keeping | None, layout: str, tp_unavailable: str | None = None) -> None:
    """Refuse a layout that cannot keep FP8 weights when the load keeps them, or a model `tp` cannot run."""
    if keeping is not None and tp_unavailable:
        raise ValueError(
            f"model.fp8_weights keeps FP8 weights under parallel.decode tp only, which this model cannot use "
            f"({tp_unavailable}); set model.fp8_weights dequantize"
        )
    if keeping is not None and layout not in KEEP_LAYOUTS:
        raise ValueError(
            f"model.fp8_weights keeps FP8 weights under parallel.decode {', '.join(KEEP_LAYOUTS)} only, and "
            f"parallel.decode is {layout} (FSDP2's gather and reshard dequantize): set parallel.decode tp (or auto), "
            "or model.fp8_weights dequantize"
        )
