"""`model.fp8_weights`: whether a load keeps a checkpoint's FP8 block weights as FP8, and reading them so.

- `dequantize` (the default until the FP8 path is measured): every quantized weight is dequantized
  to the compute dtype, as `weight_reading` does for every format.
- `keep`: on a device where torch's blockwise FP8 matmul runs (CUDA, compute capability 8.9 or
  higher, checked by running it once), the `tp` layout keeps each linear weight stored as e4m3
  blocks with a `weight_scale_inv` as FP8 codes with their scales (`parallel.fp8_linear`), at half
  the weight bytes of bf16. Anywhere else the request is overridden: a warning says why and the
  weights are dequantized as with `dequantize`.
- `keep-reference`: keeps them on any device and computes with the reference path (a piece of the
  weight dequantized at a time): slow, for checking the FP8 path where no kernel runs (the tests).

Only the `tp` layout keeps FP8 weights (FSDP2's `gather` and `reshard` dequantize): with a keeping
choice `auto` means `tp`, and an explicit `gather` or `reshard` is refused. Weights in other
formats (e5m2, MXFP4, INT4, fused experts) are dequantized whatever the choice.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from shardbook.rankd.loading.checkpoint_names import Selection, select
from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.loading.quantized_formats import quantization_settings
from shardbook.rankd.loading.safetensors_files import MappedFiles
from shardbook.rankd.parallel.fp8_linear import KEEPABLE, keep_fp8, kernel_fits, kernel_unavailable

log = logging.getLogger(__name__)

KEEP_LAYOUTS = ("tp",)


@dataclass
class FP8Keeping:
    """A load that keeps FP8 block weights: with torch's kernel where a shard fits it, or by the reference path."""

    kernel: bool
    files: MappedFiles = field(default_factory=MappedFiles)

    def module_of(self, model: nn.Module, names: list[str], stored: Any) -> nn.Module | None:
        """The linear layer whose weight `stored` is, when it is an e4m3 block weight kept in FP8; else None."""
        if len(names) != 1 or not names[0].endswith(".weight") or not _e4m3_blocks(stored):
            return None
        module = model.get_submodule(names[0].removesuffix(".weight"))
        return module if type(module) in KEEPABLE else None

    def keep(self, module: nn.Module, name: str, stored: QuantizedTensor, selection: Selection, device) -> torch.Tensor:
        """Make `module` an FP8 layer over `selection` of `stored`; the e4m3 codes its `weight` is to hold."""
        rows, columns = selection
        if columns is not None and len(columns) != 1:
            raise ValueError(
                f"{name} is split into {len(columns)} column ranges on one rank, which model.fp8_weights keep cannot "
                "hold in FP8 (one range of columns per rank): set model.fp8_weights dequantize"
            )
        codes = select(self.files.view(stored.codes).view(torch.uint8), selection)
        codes = codes.to(device).contiguous().view(stored.codes.dtype)
        scales, lead = _row_scales(stored, self.files, rows, columns[0] if columns else range(stored.values[1]))
        block = stored.block[1]
        keep_fp8(module, scales.to(device), lead, block, self.kernel and kernel_fits(codes, lead, block))
        return codes


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
