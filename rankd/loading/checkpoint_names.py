"""Which stored tensors fill each model tensor: transformers' own conversion mapping applied to the checkpoint's names.

Mixture-of-experts checkpoints store every expert apart (`mlp.experts.3.gate_proj.weight`), while
transformers 5 models hold them fused (`mlp.experts.gate_up_proj`, experts x 2I x H) and convert
on load with the mapping of `transformers.conversion_mapping`. Sharded loading asks that same
mapping how names change (`WeightRenaming`, e.g. Mixtral's `block_sparse_moe` -> `mlp`) and which
stored tensors merge into one (`WeightConverter`), and describes each fused tensor as an
`ExpertStack` that can read any slice of it (some experts, some rows) from the per-expert tensors
without building the whole. Conversions other than stacking experts and concatenating gate with
up are refused with a clear error rather than guessed.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

import torch
from torch import nn

from shardbook.rankd.loading.dequantize import QuantizedTensor
from shardbook.rankd.loading.safetensors_files import MappedFiles, StoredTensor

Selection = tuple  # per dim: a tuple of ranges to keep (joined in order), or None for the whole dim


@dataclass(frozen=True)
class ExpertStack:
    """A fused expert tensor: `parts[p][e]` stored per expert, stacked on dim 0, the parts joined on `concat_dim`."""

    parts: tuple[tuple[StoredTensor | QuantizedTensor, ...], ...]
    concat_dim: int | None
    """The fused tensor's dim the parts are concatenated on (gate then up), None for a single part."""

    @property
    def shape(self) -> tuple[int, ...]:
        one = list(self.parts[0][0].shape)
        if self.concat_dim is not None:
            one[self.concat_dim - 1] = sum(part[0].shape[self.concat_dim - 1] for part in self.parts)
        return (len(self.parts[0]), *one)

    @property
    def file(self):
        """The file of the first expert's first part (for messages about this tensor)."""
        return self.parts[0][0].file

    def read(self, files: MappedFiles, selection: Selection, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """The `selection` of the fused tensor, built from only the experts and rows it needs."""
        inner = selection[1:]
        return torch.stack([self._expert(files, e, inner, dtype, device) for e in self.experts(selection[0])])

    def experts(self, ranges: tuple[range, ...] | None) -> list[int]:
        """The experts (dim 0 indices) a selection's `ranges` keep, in order."""
        return [e for piece in ranges for e in piece] if ranges is not None else list(range(len(self.parts[0])))

    @property
    def axis(self) -> int:
        """The dim of one expert's tensor that the parts are joined on."""
        return 0 if self.concat_dim is None else self.concat_dim - 1

    def pieces(self, expert: int, inner: Selection) -> list[tuple[StoredTensor | QuantizedTensor, Selection]]:
        """The stored tensors, each with its selection, whose joining on `axis` is `inner` of `expert`'s tensor."""
        stored = [part[expert] for part in self.parts]
        axis = self.axis
        return [
            (stored[part], tuple((rows,) if dim == axis else sel for dim, sel in enumerate(inner)))
            for part, rows in _concat_pieces([s.shape[axis] for s in stored], inner[axis])
        ]

    def _expert(self, files: MappedFiles, expert: int, inner: Selection, dtype, device) -> torch.Tensor:
        pieces = [
            read_part(files, stored, selection, dtype, device) for stored, selection in self.pieces(expert, inner)
        ]
        return torch.cat(pieces, dim=self.axis)


def read_part(
    files: MappedFiles, stored: StoredTensor | QuantizedTensor, selection: Selection, dtype, device
) -> torch.Tensor:
    """`selection` of one stored tensor (dequantized when it is quantized), on `device` in `dtype`."""
    if isinstance(stored, QuantizedTensor):
        return stored.read(files, selection, dtype, device)
    return select(files.view(stored), selection).to(device=device, dtype=dtype)


def _concat_pieces(sizes: list[int], ranges: tuple[range, ...] | None) -> list[tuple[int, range]]:
    """(part, its rows) that `ranges` (in the concatenated parts' coordinates) cover, in order."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = []
    for wanted in ranges if ranges is not None else (range(sum(sizes)),):
        for part, (start, size) in enumerate(zip(starts, sizes)):
            low, high = max(wanted.start, start), min(wanted.stop, start + size)
            if low < high:
                pieces.append((part, range(low - start, high - start)))
    return pieces


def select(tensor: torch.Tensor, selection: Selection) -> torch.Tensor:
    """`tensor` cut to `selection`: a view while every sliced dim keeps one range, else a joined copy."""
    for dim, ranges in enumerate(selection):
        if ranges is None:
            continue
        parts = [tensor.narrow(dim, r.start, len(r)) for r in ranges]
        tensor = parts[0] if len(parts) == 1 else torch.cat(parts, dim=dim)
    return tensor


def checkpoint_sources(model: nn.Module, index: dict[str, StoredTensor]) -> dict[str, StoredTensor | ExpertStack]:
    """Every model tensor name the checkpoint fills, with the stored tensor or expert stack that fills it."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, apply_renamings, rename_source_key

    transforms = get_model_conversion_mapping(model, add_legacy=False)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    sources: dict[str, StoredTensor | ExpertStack] = {}
    groups: dict[str, tuple] = {}
    members: dict[str, dict[str, list[tuple[str, StoredTensor]]]] = defaultdict(lambda: defaultdict(list))
    for key, stored in index.items():
        if _names_a_model_tensor(key, meta, model.base_model_prefix):
            sources[_with_prefix(key, meta, model.base_model_prefix)] = stored
            continue
        renamed = apply_renamings(key, renamings)
        converter, pattern = _converter_for(renamed, converters)
        target = converter.rename_source_key(renamed)[0] if converter else renamed
        target, _ = rename_source_key(target, [], [], model.base_model_prefix, meta)  # base-model prefix only
        if converter is None:
            sources[target] = stored
        else:
            groups[target] = converter
            members[target][pattern].append((key, stored))
    for target, converter in groups.items():
        experts = meta[target].shape[0] if target in meta else None
        sources[target] = _expert_stack(target, converter, members[target], experts)
    return sources


def _names_a_model_tensor(key: str, meta: dict, prefix: str) -> bool:
    """A stored name that already is a model tensor's (with or without the base-model prefix) is taken as it is.

    Renamings are unscoped patterns: DeepSeek-V4's `\\.norm\\.` -> `.kv_norm.` is meant for the
    attention's norm, but would also turn `model.norm.weight` (the final norm) into a name no tensor has.
    """
    return key in meta or f"{prefix}.{key}" in meta or key.removeprefix(f"{prefix}.") in meta


def _with_prefix(key: str, meta: dict, prefix: str) -> str:
    if key in meta:
        return key
    return f"{prefix}.{key}" if f"{prefix}.{key}" in meta else key.removeprefix(f"{prefix}.")


def _converter_for(key: str, converters: list) -> tuple:
    for converter in converters:
        _, pattern = converter.rename_source_key(key)
        if pattern is not None:
            return converter, pattern
    return None, None


def _expert_stack(
    target: str, converter, by_pattern: dict[str, list[tuple[str, StoredTensor]]], experts: int | None
) -> ExpertStack:
    """The `ExpertStack` a supported conversion builds: experts stacked on dim 0, then parts joined on dim 1.

    `experts` is how many the model has (the fused tensor's dim 0): a stored tensor missing for
    one of them is named, rather than showing later as a stack of the wrong shape.
    """
    from transformers.core_model_loading import Concatenate, MergeModulelist, dot_natural_key

    ops = [(type(op), getattr(op, "dim", None)) for op in converter.operations]
    merge_only, merge_concat = [(MergeModulelist, 0)], [(MergeModulelist, 0), (Concatenate, 1)]
    if ops not in (merge_only, merge_concat):
        names = ", ".join(type(op).__name__ for op in converter.operations)
        raise ValueError(
            f"{target} is built on load by transformers' conversion ({names}), which sharded loading does not "
            "do yet (it stacks per-expert tensors and joins gate with up); load this model with transformers "
            "in one process, or convert the checkpoint with save_pretrained in that layout"
        )
    parts = []
    for pattern in converter.source_patterns:
        found = sorted(by_pattern.get(pattern, []), key=lambda item: dot_natural_key(item[0]))
        if found and experts is not None:
            _require_every_expert(target, pattern, [key for key, _ in found], experts)
        parts.append(tuple(stored for _, stored in found))
    counts = {len(part) for part in parts}
    if len(counts) != 1 or 0 in counts:
        raise ValueError(
            f"{target} needs {' and '.join(converter.source_patterns)} for every expert, but the checkpoint holds "
            f"{[len(part) for part in parts]} of them: the checkpoint is incomplete"
        )
    return ExpertStack(parts=tuple(parts), concat_dim=1 if ops == merge_concat else None)


def _require_every_expert(target: str, pattern: str, keys: list[str], experts: int) -> None:
    """Raise naming the stored tensors `pattern` lacks for experts 0..experts-1 (keys are the stored names)."""
    star = re.compile(re.escape(pattern).replace(r"\*", r"(\d+)"))
    indices: dict[int, str] = {}
    for key in keys:
        match = star.search(key)
        if match is not None:
            indices[int(match.group(1))] = key
    absent = [index for index in range(experts) if index not in indices]
    if not absent or not indices:
        return
    some_key = next(iter(indices.values()))
    match = star.search(some_key)
    start, stop = match.span(1)
    names = [f"{some_key[:start]}{index}{some_key[stop:]}" for index in absent]
    raise ValueError(
        f"the checkpoint lacks {', '.join(names[:3])}{' and more' if len(names) > 3 else ''} "
        f"({len(names)} of the {experts} experts' tensors that {target} is built from): the checkpoint is incomplete"
    )
