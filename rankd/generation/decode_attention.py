"""Decode attention on a CPU through a small C kernel: every row and head of a decode step in one call, each row
over its own positions only.

Why: for one query token per row, torch's `scaled_dot_product_attention` on a CPU runs its general flash-attention
loop over every column of the left-padded cache, and transformers' `sdpa` repeats the key heads for each query
head when a mask is given. `decode_attention.c` reads each position's key once for all the query heads that share
it, four positions at a time, and only the row's own positions, in one call for the whole step (no call per row).
On the demo model's shape, one layer, float32, one thread (`bench/bench_ragged_attention.py`, bench/RESULTS.md):
0.5x to 0.9x the padded call's time with rows of equal length, and a small fraction of it with one long row among
short ones, where the padded call pays the long row's columns for every row.

The kernel is compiled once per machine with the system's C compiler (`CC`, else `cc`) for this CPU
(`-march=native`), into the user's cache directory under a name that hashes the source, the flags and the CPU's
model and flags (a home directory shared by the nodes of a cluster holds one build per kind of CPU), and loaded
with ctypes. Without a compiler, or where the build fails, it is not used (`available()` says so, and why, in the
log once) and the batch attends as before (`row_attention`). `SHARDBOOK_DECODE_ATTENTION=0` turns it off.

It takes float32 or bfloat16 keys and values, computes in float32, and needs head sizes that are multiples of 8
(the values' may differ from the keys', as MLA's do) and at most 16 query heads per key head; `decode_attention`
returns None for anything else and the caller falls back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from functools import cache
from pathlib import Path

import torch

log = logging.getLogger(__name__)

SWITCH = "SHARDBOOK_DECODE_ATTENTION"
SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC")
MAX_GROUP = 16
"""Query heads per key/value head the kernel takes (decode_attention.c's MAX_GROUP)."""
_KERNELS = {torch.float32: "decode_attention_f32", torch.bfloat16: "decode_attention_bf16"}
_lock = threading.Lock()


def available() -> bool:
    """Whether this process can attend through the kernel (built or loaded once; the reason it cannot is logged)."""
    return _library() is not None


def decode_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, starts: torch.Tensor, scale: float
) -> torch.Tensor | None:
    """Attention of `query` (rows, heads, 1, dim) over `key` (rows, kv heads, columns, dim) and `value` (rows, kv
    heads, columns, value dim), any strides with the last dim contiguous, row b over its columns `starts[b]`
    (int64) to the last: (rows, heads, 1, value dim) in the query's dtype, or None where the kernel does not apply
    (see the module)."""
    if not _fits(query, key, value) or key.shape[0] != query.shape[0]:
        return None
    layout = [key.shape[2], 0, 0]
    return _attend(query, key, value, starts, None, layout, scale)


def paged_decode_attention(
    query: torch.Tensor,
    key_pool: torch.Tensor,
    value_pool: torch.Tensor,
    table: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
) -> torch.Tensor | None:
    """Attention of `query` (rows, heads, 1, dim) over each row's own positions in a paged cache: `key_pool` (blocks,
    kv heads, block size, dim) and `value_pool` alike (value dim), row b's `lengths[b]` positions in the blocks
    `table[b]` (int64, rows x table width) in order. As `decode_attention` returns, or None."""
    block = key_pool.shape[2]
    if not _fits(query, key_pool, value_pool) or block % 4 or table.shape[0] != query.shape[0]:
        return None
    if table.dtype != torch.int64 or lengths.dtype != torch.int64 or not table.is_contiguous():
        return None
    layout = [int(lengths.max()) if lengths.numel() else 0, block, table.shape[1]]
    return _attend(query, key_pool, value_pool, lengths, table, layout, scale)


def _attend(query, key, value, extent, table, layout: list[int], scale: float) -> torch.Tensor | None:
    """Call the kernel for `key`'s dtype; `layout` is (columns, block, table width) as decode_attention.c reads it."""
    kernels = _kernels()
    kernel = kernels.get(key.dtype) if kernels else None
    if kernel is None:
        return None
    rows, heads, _, dim = query.shape
    q = query.reshape(rows, heads, dim)
    if q.dtype != torch.float32 or not q.is_contiguous():
        q = q.to(torch.float32).contiguous()
    value_dim = value.shape[3]
    out = torch.empty(rows, heads, 1, value_dim, dtype=torch.float32)
    shape = torch.tensor([rows, heads, key.shape[1], dim, value_dim, *layout], dtype=torch.int64)
    strides = torch.tensor([*key.stride()[:3], *value.stride()[:3]], dtype=torch.int64)
    failed = kernel(
        q.data_ptr(),
        key.data_ptr(),
        value.data_ptr(),
        extent.data_ptr(),
        None if table is None else table.data_ptr(),
        shape.data_ptr(),
        strides.data_ptr(),
        scale,
        torch.get_num_threads(),
        out.data_ptr(),
    )
    if failed:
        raise MemoryError(f"decode attention could not allocate its scores (kernel returned {failed})")
    return out if query.dtype == torch.float32 else out.to(query.dtype)


def _fits(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """The shapes, dtypes and layouts the kernel takes (CPU tensors, one query token, GQA within MAX_GROUP); the
    rows are the caller's to check."""
    if type(query) is not torch.Tensor or type(key) is not torch.Tensor or type(value) is not torch.Tensor:
        return False  # a DTensor or another subclass
    if query.dim() != 4 or key.dim() != 4 or key.shape[:3] != value.shape[:3] or key.dtype != value.dtype:
        return False
    _, heads, tokens, dim = query.shape
    _, kv_heads, _, kv_dim = key.shape
    return (
        tokens == 1
        and dim == kv_dim
        and dim % 8 == 0
        and value.shape[3] % 8 == 0
        and heads % kv_heads == 0
        and heads // kv_heads <= MAX_GROUP
        and query.device.type == key.device.type == value.device.type == "cpu"
        and query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
    )


def _kernels() -> dict | None:
    """The kernel's function by key dtype, or None where it is not built."""
    library = _library()
    return None if library is None else library.kernels


@cache
def _library() -> ctypes.CDLL | None:
    if os.environ.get(SWITCH, "1") == "0":
        return None
    try:
        with _lock:
            library = ctypes.CDLL(str(_built()))
    except (OSError, subprocess.SubprocessError) as error:
        log.info("decode attention through the C kernel is off: %s", error)
        return None
    library.kernels = {}
    for dtype, name in _KERNELS.items():
        kernel = getattr(library, name)
        kernel.restype = ctypes.c_int
        kernel.argtypes = [ctypes.c_void_p] * 7 + [ctypes.c_float, ctypes.c_int, ctypes.c_void_p]
        library.kernels[dtype] = kernel
    return library


def _built() -> Path:
    """The shared library for this source, flags and CPU, compiled into the cache directory if it is not there
    (written under a temporary name and renamed, so ranks that build at once never load a partial file)."""
    compiler = os.environ.get("CC", "cc")
    target = _cache_dir() / f"decode_attention-{_build_key(compiler)}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        try:
            subprocess.run(
                [compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"],
                check=True,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except FileNotFoundError as error:
            raise OSError(f"no C compiler ({compiler}: {error.strerror}; set CC to one)") from error
        except subprocess.CalledProcessError as error:
            raise OSError(f"{compiler} could not build {SOURCE.name}: {error.stderr.strip()[-400:]}") from error
        os.replace(built, target)
    return target


def _build_key(compiler: str) -> str:
    digest = hashlib.sha256(SOURCE.read_bytes())
    digest.update(repr((compiler, FLAGS, platform.machine(), _cpu_identity())).encode())
    return digest.hexdigest()[:16]


def _cpu_identity() -> str:
    """The CPU's model and feature flags (what -march=native compiles for), as /proc/cpuinfo gives them."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _cache_dir() -> Path:
    import platformdirs

    return Path(platformdirs.user_cache_dir("shardbook")) / "kernels"
