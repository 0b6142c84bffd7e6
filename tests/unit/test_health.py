"""/health: the ranks' state (idle, busy, loading, silent, dead), the queue, and 503 when they cannot serve."""

from __future__ import annotations

from types import SimpleNamespace

from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.kernel.ranks.liveness import RankState, ranks_health
from shardbook.kernel.server.state import ServeOptions, ServerState


def states(**extra) -> list[RankState]:
    ranks = [RankState(rank=0, connected=True), RankState(rank=1, connected=True)]
    for name, value in extra.items():
        setattr(ranks[1], name, value)
    return ranks


def server(ranks: dict, loaded: bool = True) -> ServerState:
    config = SimpleNamespace(model=SimpleNamespace(model_name_or_path="/models/demo"))
    runtime = SimpleNamespace(
        pool=SimpleNamespace(health=lambda: ranks),
        generation_queue=GenerationQueue(),
        ctx0=SimpleNamespace(state={"config": config, "loaded": object()} if loaded else {}),
    )
    return ServerState(runtime, ServeOptions(port=0))


def test_each_rank_is_idle_busy_silent_dead_or_connecting():
    assert [r["state"] for r in ranks_health(states(), set(), False)["ranks"]] == ["idle", "idle"]
    assert ranks_health(states(), {0, 1}, False)["busy"] is True
    silent = ranks_health(states(silent_s=10.0), set(), False)
    assert (silent["silent_ranks"], silent["can_serve"], silent["ranks"][1]["state"]) == ([1], True, "silent")
    dead = ranks_health(states(dead_reason="its process (pid 7) exited"), set(), False)
    assert (dead["dead_ranks"], dead["can_serve"]) == ([1], False)
    assert "pid 7" in dead["ranks"][1]["reason"]
    assert ranks_health(states(connected=False), set(), False)["can_serve"] is False


def test_health_is_503_without_a_model_or_with_a_dead_rank_and_says_what_the_ranks_do():
    idle = ranks_health(states(), set(), False)
    assert server(idle).health() == (
        200,
        {**idle, "status": "ok", "model": "demo", "waiting": 0, "running": None, "batch_running": 0},
    )
    code, body = server(idle, loaded=False).health()
    assert (code, body["status"]) == (503, "no_model")
    code, body = server(ranks_health(states(dead_reason="gone"), set(), False)).health()
    assert (code, body["status"], body["dead_ranks"]) == (503, "rank_dead", [1])
    code, body = server(ranks_health(states(), {0, 1}, True)).health()
    assert (code, body["status"], body["loading"]) == (200, "loading", True)
    busy = server(ranks_health(states(), {0, 1}, False))
    busy.runtime.generation_queue.enter("http").wait()
    busy.runtime.generation_queue.enter("chat")
    code, body = busy.health()
    assert (code, body["status"], body["running"], body["waiting"]) == (200, "busy", "http", 1)
    code, body = server(ranks_health(states(silent_s=30.0), set(), False)).health()
    assert (code, body["silent_ranks"]) == (200, [1])
