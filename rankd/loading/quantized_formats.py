"""The quantized checkpoint formats sharded loading reads, as `QuantizedTensor`s in place of their stored parts.

`config.json`'s `quantization_config` names the method; the tensors say the rest. Each format's
parts (codes, scales, a shape) are paired by name into one entry under the name of the weight the
model holds, so the conversion mapping (`checkpoint_names`) and every layout's reads see one
tensor of the model's shape, whatever the file holds:

- `fp8` (transformers' fine-grained FP8: DeepSeek-V3/V3.1/V3.2, Kimi-K2, MiniMax-M2, GLM-5-FP8,
  Qwen3-FP8): `X.weight` in e4m3 or e5m2 with `X.weight_scale_inv` (or DeepSeek-V4's `X.scale`),
  in `weight_block_size` blocks (partial last blocks included) or one scale per tensor, float32 or
  power-of-two (`ue8m0`) scales; int8 weights beside a scale are DeepSeek-V4's FP4 experts (two
  e2m1 values a byte, one scale per 32 along a row);
- `mxfp4` (gpt-oss): `P_blocks` / `P_scales` expert tensors, stored out x in and held in x out;
- `compressed-tensors`: `pack-quantized` int4 / int8 (`weight_packed`, `weight_scale`,
  `weight_shape`; Kimi-K2-Thinking) and `float-quantized` FP8 (`weight`, `weight_scale`), by
  tensor, channel, group or block.

Modules the config leaves unquantized (`modules_to_not_convert`, `ignore`) are stored in a float
dtype without scales and are read as they are. Anything else, and any part that is missing or
does not fit its weight, is refused here, on every rank, before a weight is read.
"""

from __future__ import annotations

from typing import Any

import torch

from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.loading.safetensors_files import MappedFiles, StoredTensor

Index = dict[str, StoredTensor | QuantizedTensor]

SUPPORTED = "fp8 (fine-grained FP8 blocks), mxfp4, compressed-tensors (pack-quantized int4/int8, float-quantized FP8)"
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
PER_TENSOR_SCALE = ".weight_scale"
"""One multiplier for a whole FP8 tensor, whatever `weight_block_size` says: transformers' `FP8Embedding` stores an
embedding table of `modules_to_convert` so (shape [1]; value = code x scale), beside linears in blocks."""
FP8_SCALE_SUFFIXES = (".weight_scale_inv", ".scale", ".qscale_weight", PER_TENSOR_SCALE)
ACTIVATION_SUFFIXES = (".input_scale", ".activation_scale", ".input_zero_point")
"""Static activation quantization: an inference-time matter that dequantized weights do not need."""


def dequantizing_index(index: dict[str, StoredTensor], config: Any) -> Index:
    """`index` with every quantized weight's stored parts replaced by one `QuantizedTensor` under the weight's name."""
    settings = quantization_settings(config)
    if settings is None:
        _refuse_unexplained_scales(index)
        return dict(index)
    method = settings.get("quant_method")
    if method not in FORMATS:
        raise ValueError(
            f"config.json's quantization_config has quant_method {method!r}, which sharded loading does not read "
            f"(it reads {SUPPORTED}): dequantize the checkpoint offline (transformers' from_pretrained and "
            "save_pretrained on a machine that can run that method), or pick the checkpoint's bf16 or FP8 release"
        )
    return FORMATS[method](dict(index), settings)


def quantization_settings(config: Any) -> dict[str, Any] | None:
    """The checkpoint's `quantization_config` as a dict, or None for an unquantized checkpoint."""
    settings = getattr(config, "quantization_config", None)
    if settings is None or isinstance(settings, dict):
        return settings
    return settings.to_dict()


def _refuse_unexplained_scales(index: dict[str, StoredTensor]) -> None:
    scaled = [name for name in index if name.endswith((".weight_scale_inv", ".weight_scale", "_scales"))]
    if scaled:
        raise ValueError(
            f"the checkpoint holds quantization scales (e.g. {scaled[0]}) but its config.json has no "
            "quantization_config, so nothing says how to read them: restore the config.json the checkpoint was "
            "published with"
        )


def _fp8(index: dict[str, StoredTensor], settings: dict) -> Index:
    block = settings.get("weight_block_size")
    for name in [n for n in index if n.endswith(".weight")]:
        weight = index[name]
        scale_name = _scale_of(index, name.removesuffix(".weight"), weight)
        if scale_name is None:
            _require_unquantized(name, weight, f"{name}_scale_inv")
            continue
        scales = index.pop(scale_name)
        if weight.dtype in FP8_DTYPES:
            per_tensor = not block or scale_name.endswith(PER_TENSOR_SCALE)
            values, code = weight.shape, "float"
            blocks = values if per_tensor else _leading_ones(values, block)
            layout = "per tensor" if per_tensor else f"{block[0]}x{block[1]} blocks"
            label = f"fp8 {_fp8_name(weight.dtype)}, {layout}"
        else:  # int8 beside a scale: two e2m1 values a byte, a scale per 32 values of a row (DeepSeek-V4's experts)
            values, code = (*weight.shape[:-1], 2 * weight.shape[-1]), "e2m1"
            blocks, label = (*(1,) * (len(values) - 1), 32), "fp4 e2m1 experts, 1x32 blocks"
        scale_code = "e8m0" if scales.dtype.itemsize == 1 else "float"  # ue8m0 bytes; float32 powers of two multiply
        index[name] = _quantized(name, weight, scales, values, blocks, code, scale_code, label)
    return _drop_activation_scales(index)


def _scale_of(index: dict, module: str, weight: StoredTensor) -> str | None:
    """The name of `weight`'s scale tensor; `.scale` counts only beside a weight stored as codes (not a norm's),
    `.weight_scale` only beside FP8 codes."""
    coded = weight.dtype in FP8_DTYPES or weight.dtype in (torch.int8, torch.uint8)
    allowed = {".scale": coded, PER_TENSOR_SCALE: weight.dtype in FP8_DTYPES}
    for suffix in FP8_SCALE_SUFFIXES:
        name = module + suffix
        if name in index and allowed.get(suffix, True):
            return name
    return None


def _fp8_name(dtype: torch.dtype) -> str:
    return "e4m3" if dtype == torch.float8_e4m3fn else "e5m2"


def _leading_ones(values: tuple[int, ...], block: list[int]) -> tuple[int, ...]:
    """A 2-D block size for a tensor of any rank: one scale per block of its last two dims (experts stacked first)."""
    return (*(1,) * (len(values) - len(block)), *block)


def _mxfp4(index: dict[str, StoredTensor], settings: dict) -> Index:
    for name in [n for n in index if n.endswith("_blocks")]:
        base = name.removesuffix("_blocks")
        scales = index.pop(f"{base}_scales", None)
        if scales is None:
            raise _missing(f"{base}_scales", name)
        blocks = index.pop(name)
        values = (*blocks.shape[:-2], blocks.shape[-2] * blocks.shape[-1] * 2)
        order = (*range(len(values) - 2), len(values) - 1, len(values) - 2)  # stored out x in, held in x out
        label = "mxfp4 e2m1, 1x32 blocks"
        index[base] = _quantized(
            name, blocks, scales, values, (*(1,) * (len(values) - 1), 32), "e2m1", "e8m0", label, order
        )
    _refuse_left_over(index, "_scales", "_blocks")
    return _drop_activation_scales(index)


def _compressed_tensors(index: dict[str, StoredTensor], settings: dict) -> Index:
    weights = _one_weight_scheme(settings)
    _refuse_activation_order(index)
    packed = [n for n in index if n.endswith(".weight_packed")]
    if packed:
        _read_packed(index, packed, weights)
    else:
        _read_float_quantized(index, weights)
    return _drop_activation_scales(index)


def _one_weight_scheme(settings: dict) -> dict:
    """The `weights` arguments every config group shares (a checkpoint mixing schemes is refused)."""
    form = settings.get("format")
    groups = settings.get("config_groups") or {}
    schemes = {repr(sorted((group.get("weights") or {}).items())): group for group in groups.values()}
    forms = sorted({str(group.get("format") or form) for group in groups.values()})
    if len(schemes) != 1 or forms not in (["pack-quantized"], ["float-quantized"]):
        raise ValueError(
            f"this compressed-tensors checkpoint's config_groups use format(s) {forms} with "
            f"{len(schemes)} weight scheme(s); sharded loading reads one scheme per checkpoint in pack-quantized "
            "(int4/int8) or float-quantized (FP8): dequantize it offline with compressed-tensors, or pick a "
            "checkpoint in one of those"
        )
    weights = next(iter(schemes.values()))["weights"]
    if weights.get("symmetric") is False or weights.get("type") not in ("int", "float"):
        raise ValueError(
            f"compressed-tensors weights {weights} are not read yet (sharded loading reads symmetric int and float "
            "weights): dequantize the checkpoint offline with compressed-tensors"
        )
    return weights


def _refuse_activation_order(index: dict[str, StoredTensor]) -> None:
    """GPTQ's `actorder: group` stores each column's group in `X.weight_g_idx`; read by position, the columns would
    take other groups' scales."""
    ordered = [name for name in index if name.endswith(".weight_g_idx")]
    if ordered:
        more = f" and {len(ordered) - 1} more" if len(ordered) > 1 else ""
        raise ValueError(
            f"this compressed-tensors checkpoint assigns columns to groups out of order (actorder 'group': "
            f"{ordered[0]}{more}), which sharded loading does not read; read by position its "
            "weights would take other groups' scales: dequantize it offline with compressed-tensors, or pick a "
            "checkpoint quantized without activation ordering or with actorder 'weight'"
        )


def _read_packed(index: dict, names: list[str], weights: dict) -> None:
    bits = weights.get("num_bits")
    if bits not in (4, 8):
        raise ValueError(
            f"compressed-tensors pack-quantized weights of {bits} bits are not read (4 and 8 are): dequantize the "
            "checkpoint offline with compressed-tensors"
        )
    files = MappedFiles()
    for name in names:
        module = name.removesuffix(".weight_packed")
        scales, shape = (index.pop(f"{module}.{part}", None) for part in ("weight_scale", "weight_shape"))
        for part, found in (("weight_scale", scales), ("weight_shape", shape)):
            if found is None:
                raise _missing(f"{module}.{part}", name)
        values = tuple(int(n) for n in files.view(shape).tolist())
        blocks = _scheme_blocks(weights, values, name)
        label = f"compressed-tensors int{bits}, " + _describe_blocks(weights)
        codes = index.pop(name)
        index[f"{module}.weight"] = _quantized(name, codes, scales, values, blocks, f"int{bits}", "float", label)


def _read_float_quantized(index: dict, weights: dict) -> None:
    for name in [n for n in index if n.endswith(".weight")]:
        weight = index[name]
        scales = index.pop(name.removesuffix(".weight") + ".weight_scale", None)
        if scales is None:
            _require_unquantized(name, weight, name + "_scale")
            continue
        blocks = _scheme_blocks(weights, weight.shape, name)
        label = f"compressed-tensors fp8 {_fp8_name(weight.dtype)}, " + _describe_blocks(weights)
        index[name] = _quantized(name, weight, scales, weight.shape, blocks, "float", "float", label)


def _scheme_blocks(weights: dict, values: tuple[int, ...], name: str) -> tuple[int, ...]:
    """Elements per scale along each dim, by the scheme's strategy."""
    strategy = weights.get("strategy")
    lead = (1,) * (len(values) - 1)
    if strategy == "tensor":
        return values
    if strategy == "channel":
        return (*lead, values[-1])
    if strategy == "group" and weights.get("group_size"):
        return (*lead, int(weights["group_size"]))
    if strategy == "block" and weights.get("block_structure"):
        return _leading_ones(values, weights["block_structure"])
    raise ValueError(
        f"{name}: compressed-tensors strategy {strategy!r} (with {weights}) is not read (tensor, channel, group and "
        "block are): dequantize the checkpoint offline with compressed-tensors"
    )


def _describe_blocks(weights: dict) -> str:
    strategy = weights.get("strategy")
    if strategy == "group":
        return f"groups of {weights['group_size']}"
    if strategy == "block":
        return "x".join(map(str, weights["block_structure"])) + " blocks"
    return f"per {strategy}"


def _quantized(
    name: str,
    codes: StoredTensor,
    scales: StoredTensor,
    values: tuple[int, ...],
    block: tuple[int, ...],
    code: str,
    scale_code: str,
    label: str,
    order: tuple[int, ...] | None = None,
) -> QuantizedTensor:
    """The `QuantizedTensor`, after checking its scales fit the grid its shape and blocks call for."""
    tensor = QuantizedTensor(
        codes=codes,
        scales=scales,
        values=tuple(values),
        block=tuple(int(b) for b in block),
        code=code,
        scale_code=scale_code,
        order=order or tuple(range(len(values))),
        format=label,
    )
    if len(tensor.block) != len(tensor.values) or not _fits(scales.shape, tensor.grid()):
        raise ValueError(
            f"{codes.file.name} holds {name} of {list(values)} values with scales of shape {list(scales.shape)}, "
            f"but {label} needs a scale grid of {list(tensor.grid())} (ceil(shape / block)) in that shape (as "
            "many scales laid out otherwise would land on the wrong blocks): the scales do not "
            "belong to this weight, or config.json's quantization_config does not describe these files; restore "
            "the checkpoint's own config.json, or copy or download the checkpoint again"
        )
    return tensor


def _fits(shape: tuple[int, ...], grid: tuple[int, ...]) -> bool:
    """Whether scales of `shape` are the `grid` a weight calls for: the grid's own shape (as every format stores
    them: blocks, channels as [rows, 1], groups, MXFP4's [experts, rows, blocks]), or one scale for a grid of one
    block as per-tensor scales are stored (transformers' scalar [], compressed-tensors' [1])."""
    one_block = all(size == 1 for size in grid)
    return tuple(shape) == tuple(grid) or (one_block and tuple(shape) in ((), (1,)))


def _require_unquantized(name: str, weight: StoredTensor, scale_name: str) -> None:
    if weight.dtype in FP8_DTYPES:
        raise _missing(scale_name, name)


def _missing(part: str, name: str) -> ValueError:
    return ValueError(
        f"the checkpoint holds {name} but not {part}, which it needs to be read (without it its codes would load "
        "as wrong values): the checkpoint is incomplete; copy or download its missing files"
    )


def _refuse_left_over(index: dict, suffix: str, partner: str) -> None:
    left = [name for name in index if name.endswith(suffix)]
    if left:
        raise _missing(left[0].removesuffix(suffix) + partner, left[0])


def _drop_activation_scales(index: dict) -> Index:
    return {name: stored for name, stored in index.items() if not name.endswith(ACTIVATION_SUFFIXES)}


FORMATS = {"fp8": _fp8, "mxfp4": _mxfp4, "compressed-tensors": _compressed_tensors}
