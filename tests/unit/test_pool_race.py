"""`Pool.run` checks that its ranks are free and registers its command in one step: two callers at once, one runs."""

from __future__ import annotations

import threading
import types

from shardbook.kernel.ranks import pool as pool_module
from shardbook.kernel.ranks.pool import Pool, PoolError
from shardbook.rankd.control.dispatch import HANDLERS, RankContext


def test_two_threads_racing_into_run_let_only_one_through(monkeypatch):
    world = types.SimpleNamespace(
        world_size=1, describe=lambda: {"rank": 0, "host": "here", "pid": 1, "device": "cpu", "backend": "gloo"}
    )
    pool = Pool(world, None, RankContext(world=world, shell=None))
    release, started = threading.Event(), []

    def hold(ctx, args, sink):  # rank 0's part of the command that got through: holds the ranks busy
        started.append(ctx.stop_event.is_set())
        release.wait(10)
        return {"status": "ok"}

    monkeypatch.setitem(HANDLERS, "test_hold", hold)
    barrier = threading.Barrier(2, timeout=1.0)
    real_new_id = pool_module.protocol.new_id

    def new_id_together():  # both callers meet here, between any check before it and any registration after it
        try:
            barrier.wait()
        except threading.BrokenBarrierError:
            pass
        return real_new_id()

    monkeypatch.setattr(pool_module.protocol, "new_id", new_id_together)
    outcomes: list = []

    def call():
        try:
            outcomes.append(pool.run("test_hold", {}, [0], lambda *a: None, lambda text: None).ok)
        except PoolError as e:
            outcomes.append(e)

    threads = [threading.Thread(target=call) for _ in range(2)]
    for thread in threads:
        thread.start()
    refused = threading.Event()
    for _ in range(100):  # the loser is refused at once, while the winner still holds the ranks
        if any(isinstance(o, PoolError) for o in outcomes):
            refused.set()
            break
        threading.Event().wait(0.05)
    release.set()
    for thread in threads:
        thread.join(10)
    assert refused.is_set(), outcomes
    assert len(started) == 1, started
    errors = [o for o in outcomes if isinstance(o, PoolError)]
    assert len(errors) == 1 and "busy" in str(errors[0]) and True in outcomes, outcomes
