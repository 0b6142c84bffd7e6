"""A pool that fails to start names the missing rank(s) and says so in the kernel's log, not only in the magics."""

from __future__ import annotations

import logging

import pytest
import torch.distributed as dist

from shardbook.kernel.ranks import runtime
from shardbook.kernel.ranks.pool import PoolError
from shardbook.rankd.control import world


def test_a_rank_that_never_arrived_is_named(monkeypatch):
    monkeypatch.setattr(world, "CONNECT_TIMEOUT_S", 0.1)
    store = dist.HashStore()
    store.set("shardbook/arrived/2", "1")  # rank 2 came, rank 1 never did
    store.add("shardbook/arrived", 1)
    with pytest.raises(RuntimeError, match=r"rank 1 of 3 did not start within SHARDBOOK_CONNECT_TIMEOUT") as failed:
        world.wait_for_every_rank(store, 3, rank=0)
    assert "only" not in str(failed.value)
    assert "rank 1 of 3" in store.get(world.STARTUP_FAILED_KEY).decode()


def test_the_start_up_failure_is_logged_by_the_kernel(monkeypatch, caplog):
    def fail(shell):
        raise RuntimeError("rank 1 of 2 did not start within SHARDBOOK_CONNECT_TIMEOUT")

    monkeypatch.setattr(runtime, "_runtime", None)
    monkeypatch.setattr(runtime, "_failure", None)
    monkeypatch.setattr(runtime, "start_runtime", fail)
    with caplog.at_level(logging.ERROR, logger=runtime.__name__), pytest.raises(PoolError, match="rank 1 of 2"):
        runtime.get_runtime(shell=object())
    assert "rank 1 of 2 did not start" in caplog.text and "failed to start" in caplog.text
