"""`model.dtype: fastest` picks the dtype each device computes in fastest. Whatever this machine's CPU has, torch's
feature checks are replaced to give each CPU's answer, and no GPU is here, so the other devices' answers replace
their checks too (the hardware is absent)."""

import types

import pytest
import torch

from shardbook.rankd.loading.load_sharded import _resolve_dtype
from shardbook.rankd.parallel import fastest_dtype as module
from shardbook.rankd.parallel.fastest_dtype import cpu_has_bf16_kernels, fastest_dtype

FLOAT32_CHECKPOINT = types.SimpleNamespace(dtype=torch.float32)


def cpu_features(monkeypatch, amx: bool, avx512_bf16: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx, raising=False)
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16, raising=False)


@pytest.mark.parametrize(
    "amx, avx512_bf16, expected",
    [(False, False, torch.float32), (True, False, torch.bfloat16), (False, True, torch.bfloat16)],
)
def test_a_cpu_computes_bf16_only_with_amx_or_avx512_bf16(monkeypatch, amx, avx512_bf16, expected):
    cpu_features(monkeypatch, amx, avx512_bf16)
    assert fastest_dtype(torch.device("cpu")) == expected
    assert _resolve_dtype("fastest", FLOAT32_CHECKPOINT, torch.device("cpu")) == expected


def test_this_machines_cpu_answers_as_torch_sees_it():
    native = torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()
    assert cpu_has_bf16_kernels() == native
    assert fastest_dtype(torch.device("cpu")) == (torch.bfloat16 if native else torch.float32)


def test_a_torch_without_the_feature_checks_reads_as_a_cpu_without_them(monkeypatch):
    monkeypatch.setattr(module, "CPU_BF16_PROBES", ("_no_such_check",))
    assert not cpu_has_bf16_kernels() and fastest_dtype(torch.device("cpu")) == torch.float32


@pytest.mark.parametrize("bf16, expected", [(True, torch.bfloat16), (False, torch.float16)])
def test_a_gpu_takes_bf16_where_it_has_it_else_float16(monkeypatch, bf16, expected):
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *args, **kwargs: bf16)
    assert fastest_dtype(torch.device("cuda")) == expected


def test_an_npu_takes_bf16():
    npu = types.SimpleNamespace(type="npu")  # torch.device("npu") needs torch_npu
    assert fastest_dtype(npu) == torch.bfloat16


def test_auto_still_means_the_checkpoints_own_dtype(monkeypatch):
    cpu_features(monkeypatch, True, True)
    assert _resolve_dtype("auto", FLOAT32_CHECKPOINT, torch.device("cpu")) == torch.float32
