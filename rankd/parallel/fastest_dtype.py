"""`model.dtype: fastest`: the dtype a device computes a model in fastest.

GPUs and NPUs compute bfloat16 in their matrix units at twice float32's rate or more and read half the bytes, so
they take bfloat16 (float16 on a GPU without bfloat16). A CPU has bfloat16 matrix kernels only with AMX or
AVX512-BF16 (Intel Sapphire Rapids and later, AMD Zen 4 and later). Without them torch converts to float32 and
back around every matrix product: `bench/bench_dtype.py` measured bfloat16 1.4x to 7x slower than float32 for the
demo model's prefill and batched decode on the two CPUs these were built on (AMD EPYC with AVX2, Intel Ice Lake
with AVX512 but neither feature), so such a CPU takes float32.
"""

from __future__ import annotations

import torch

CPU_BF16_PROBES = ("_is_amx_tile_supported", "_is_avx512_bf16_supported")
"""torch's own CPU feature checks (private, hence looked up by name: a torch without them reports neither)."""


def fastest_dtype(device: torch.device) -> torch.dtype:
    """bfloat16 where `device` has native bfloat16 matrix kernels, else float32 (float16 on an old GPU)."""
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_bf16_kernels() else torch.float32
    if device.type == "cuda" and not torch.cuda.is_bf16_supported():
        return torch.float16
    return torch.bfloat16


def cpu_has_bf16_kernels() -> bool:
    """Whether this CPU has AMX or AVX512-BF16, as torch sees it."""
    return any(bool(getattr(torch.cpu, probe, lambda: False)()) for probe in CPU_BF16_PROBES)
