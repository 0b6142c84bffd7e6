"""Rank 0's verdict on each follower: alive, silent (stopped, not busy) or dead, and why.

Heartbeats are answered without the GIL (``rankd.heartbeat``), so a silent rank is not merely
busy. Dead means gone: a local process that exited, or silence past ``SHARDBOOK_HEARTBEAT_TIMEOUT``
(a remote process cannot be checked); every verdict says which. A silent rank that answers again
is simply alive again.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shardbook.rankd.control.lifetime import pid_alive
from shardbook.rankd.control.protocol import positive_number_env

SILENCE_TIMEOUT_S = positive_number_env("SHARDBOOK_HEARTBEAT_TIMEOUT", 60.0)
"""A follower whose process may still exist is declared dead only after this long without answering heartbeats."""
SILENT_S = 3.0
"""Silence after which %dist shows a rank as silent and the cells waiting for it say so."""


@dataclass
class RankState:
    """What rank 0 knows about one rank, for ``%dist`` and for deadlines."""

    rank: int
    host: str = "?"
    pid: int | None = None
    device: str = "?"
    backend: str = "?"
    slurm: str = ""
    connected: bool = False
    silent_s: float = 0.0
    said_silent: bool = False
    memory: dict[str, int] = field(default_factory=dict)
    running: list[str] = field(default_factory=list)
    """The user functions the rank runs inside a command (heartbeats say), e.g. an intervention."""
    dead_reason: str | None = None
    local: bool = False


def judge(state: RankState, silence_s: float, closed: bool) -> tuple[str | None, str | None]:
    """Record ``silence_s`` on ``state``; return (why it is dead, or None; a notice to show once, or None).

    ``closed``: the rank's heartbeat connection, once answered, was dropped (its process ended).
    """
    state.silent_s = silence_s
    if state.local and state.pid and not pid_alive(state.pid):
        return (
            f"its process (pid {state.pid}) exited; torchrun now ends every rank of the job, so restart the kernel",
            None,
        )
    if closed:
        return f"its heartbeat connection closed: its process on {state.host} ended. Restart the kernel", None
    if silence_s > SILENCE_TIMEOUT_S:
        return _silence_reason(state), None
    if silence_s == 0.0:
        state.said_silent = False
    elif silence_s > SILENT_S and not state.said_silent:
        state.said_silent = True
        return None, (
            f"rank {state.rank} has not answered heartbeats for {SILENT_S:.0f} s: stopped, swapping or unreachable "
            "(a rank that is only busy, even holding the GIL, still answers). The cell waits for it; the stop button "
            f"interrupts, and a rank silent for {SILENCE_TIMEOUT_S:.0f} s (SHARDBOOK_HEARTBEAT_TIMEOUT) "
            "is declared dead."
        )
    return None, None


def _silence_reason(state: RankState) -> str:
    where = (
        f"its process (pid {state.pid}) still exists, so it is stopped (SIGSTOP) or hung outside Python"
        if state.local
        else f"its process on {state.host} cannot be checked from here: that node is unreachable, stopped or hung"
    )
    return (
        f"it has not answered heartbeats for {state.silent_s:.0f} s (SHARDBOOK_HEARTBEAT_TIMEOUT = "
        f"{SILENCE_TIMEOUT_S:.0f} s); {where}. Restart the kernel"
    )


def ranks_health(states: list[RankState], busy: set[int], loading: bool) -> dict:
    """What ``/health`` says of the ranks: each rank's state, and whether they can serve at all.

    ``busy``: ranks with a command pending; ``loading``: a ``load`` command is in flight.
    A dead or still-connecting rank means the ranks cannot serve (``can_serve`` False); a silent one
    is reported (it may answer again) but does not, by itself, make them unable to.
    """
    rows = []
    for s in sorted(states, key=lambda s: s.rank):
        if s.dead_reason:
            state = "dead"
        elif not s.connected:
            state = "connecting"
        elif s.silent_s > SILENT_S:
            state = "silent"
        else:
            state = "busy" if s.rank in busy else "idle"
        row = {"rank": s.rank, "state": state}
        if s.dead_reason:
            row["reason"] = s.dead_reason
        if state == "silent":
            row["silent_s"] = round(s.silent_s, 1)
        rows.append(row)
    dead = [r["rank"] for r in rows if r["state"] == "dead"]
    connecting = [r["rank"] for r in rows if r["state"] == "connecting"]
    return {
        "can_serve": not dead and not connecting,
        "loading": loading,
        "busy": bool(busy),
        "dead_ranks": dead,
        "silent_ranks": [r["rank"] for r in rows if r["state"] == "silent"],
        "ranks": rows,
    }
