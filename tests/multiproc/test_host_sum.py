"""Sums over a tensor-parallel group through shared memory (`rankd.parallel.host_sum`) on 2 gloo ranks: the same
values as gloo's, the same bits on every rank, the fallbacks, and a peer that is gone."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from shardbook.rankd.parallel import host_sum
from shardbook.rankd.parallel.host_sum import SLOT_BYTES, HostSum, PeerGone

DTYPES = [torch.float32, torch.bfloat16, torch.int64]


def sums_against_gloo(rank: int, switch: str) -> dict:
    """Many sums in a row (both buffers, every size class), each against gloo's on the same inputs."""
    import torch.distributed as dist

    from shardbook.rankd.parallel.tp_modules import all_reduce

    os.environ[host_sum.SWITCH] = switch
    group = dist.new_group([0, 1])
    mismatches, results = [], []
    for call in range(300):
        dtype = DTYPES[call % len(DTYPES)]
        numel = [1, 576, 8 * 576, SLOT_BYTES // 8][call % 4]
        generator = torch.Generator().manual_seed(call * 2 + rank)
        mine = (torch.randn(numel, generator=generator) * 100).to(dtype)
        expected = mine.clone()
        dist.all_reduce(expected, group=group)
        got = all_reduce(mine.clone(), group)
        if not torch.equal(got, expected):
            mismatches.append((call, dtype, numel))
        results.append(got)
    too_big = torch.full((SLOT_BYTES // 4 + 1,), float(rank + 1))
    all_reduce(too_big, group)  # over a slot: gloo's path, on both ranks alike
    return {
        "mismatches": mismatches,
        "results": results,
        "too_big_ok": bool(torch.all(too_big == 3.0)),
        "shared": host_sum.host_sum_for(group) is not None,
    }


def test_shared_memory_sums_equal_gloos_and_every_rank_gets_the_same_bits(ranks):
    first, second = ranks(sums_against_gloo, "1")
    assert first["shared"] and second["shared"], "the group on one host should sum through shared memory"
    assert first["mismatches"] == [] and second["mismatches"] == []
    assert all(torch.equal(a, b) for a, b in zip(first["results"], second["results"]))
    assert first["too_big_ok"] and second["too_big_ok"]


def test_the_switch_turns_shared_memory_sums_off(ranks):
    first, second = ranks(sums_against_gloo, "0")
    assert not first["shared"] and not second["shared"]
    assert first["mismatches"] == [] and second["mismatches"] == []


def test_a_bad_switch_value_names_the_variable(monkeypatch):
    monkeypatch.setenv(host_sum.SWITCH, "yes")
    with pytest.raises(ValueError, match="SHARDBOOK_HOST_SUM='yes'"):
        host_sum._wanted(None)


def lonely_sum(tmp_path, peer_pid: int) -> HostSum:
    """A HostSum for rank 0 of 2 whose rank 1 (`peer_pid`) never publishes anything."""
    return HostSum(host_sum._create(tmp_path / "segment", host_sum.segment_bytes(2)), 0, [os.getpid(), peer_pid])


def test_a_peer_that_exited_is_named_within_a_second(tmp_path):
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    waiting = lonely_sum(tmp_path, int(gone.stdout))
    start = time.monotonic()
    with pytest.raises(PeerGone, match=r"rank\(s\) \[1\] of the group have exited"):
        waiting.sum_(torch.ones(4))
    assert time.monotonic() - start < 1.5


def test_a_peer_that_never_arrives_fails_at_the_process_group_timeout(tmp_path, monkeypatch):
    monkeypatch.setenv("SHARDBOOK_PG_TIMEOUT", "1")
    waiting = lonely_sum(tmp_path, os.getpid())  # alive, never publishing
    start = time.monotonic()
    with pytest.raises(PeerGone, match=r"rank\(s\) \[1\] never arrived"):
        waiting.sum_(torch.ones(4))
    assert 0.9 < time.monotonic() - start < 3
