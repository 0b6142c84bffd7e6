"""Multi-process test harness: run a function on N gloo rank processes, with a deadline so a hang fails the test.

A module of its own (not a conftest): rank processes unpickle `_rank_main` by its module name,
and several conftest modules share the name `conftest` when pytest collects more than one folder.

`run_ranks(fn, *args)` starts `world_size` processes, each joining one gloo process group
(rendezvous through a FileStore in a temporary directory, so no port is guessed), runs
`fn(rank, *args)` with one CPU thread, and returns the list of per-rank return values. A rank
that raises fails the test with its traceback; ranks still running at the deadline are killed
and the test fails naming them, which is how "no rank hangs" is asserted.

Rank processes come from `rank_context()`: forked from one server process that imported torch,
transformers and shardbook's rank side once per session. A spawned rank spends seconds importing
them on every start (30 s for a pair on the busy 2-core CI machine); a forked one starts at once,
still a fresh process of its own (its own globals, signal handlers, process group).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import queue
import tempfile
import time
import traceback
from pathlib import Path

import pytest

PRELOAD = ["torch", "torch.distributed", "transformers", "shardbook.rankd.loading.load_sharded", "tests.tiny"]
"""What the fork server imports once; a module that fails to import there is imported by each rank instead."""


def rank_context():
    """The multiprocessing context that starts rank processes: a fork server that preloaded `PRELOAD`.

    The server starts on the first call, with OMP_NUM_THREADS=1 (torch reads it as the server imports
    it); a fork server's children get the server's environment, so `run_ranks` hands each rank the
    caller's own."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    previous = os.environ.get("OMP_NUM_THREADS")
    os.environ["OMP_NUM_THREADS"] = "1"
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        if previous is None:
            os.environ.pop("OMP_NUM_THREADS")
        else:
            os.environ["OMP_NUM_THREADS"] = previous
    return context


def _rank_main(rank: int, world_size: int, store: str, fn, args, results, environ: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(environ)  # as a spawned rank would inherit it
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world_size)
        # Plain pickle bytes: a queue would pass tensors as shared-memory handles that die with this process.
        results.put((rank, "ok", pickle.dumps(fn(rank, *args))))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, *args, world_size: int = 2, deadline: float = 90.0) -> list:
    """`fn(rank, *args)` on `world_size` gloo ranks; their return values in rank order."""
    ctx = rank_context()
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        store = str(Path(tmp) / "store")
        procs = [
            ctx.Process(
                target=_rank_main, args=(rank, world_size, store, fn, args, results, dict(os.environ)), daemon=True
            )
            for rank in range(world_size)
        ]
        for proc in procs:
            proc.start()
        outcomes = _collect(results, world_size, deadline)
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    missing = sorted(set(range(world_size)) - set(outcomes))
    if missing:
        pytest.fail(f"rank(s) {missing} did not finish within {deadline:.0f} s (hung in a collective?)")
    errors = {rank: detail for rank, (status, detail) in outcomes.items() if status == "error"}
    if errors:
        pytest.fail("\n".join(f"rank {rank} raised:\n{tb}" for rank, tb in sorted(errors.items())))
    return [pickle.loads(outcomes[rank][1]) for rank in range(world_size)]


def _collect(results, world_size: int, deadline: float) -> dict:
    outcomes: dict = {}
    end = time.monotonic() + deadline
    while len(outcomes) < world_size:
        try:
            rank, status, detail = results.get(timeout=max(0.1, end - time.monotonic()))
        except queue.Empty:
            break
        outcomes[rank] = (status, detail)
    return outcomes
