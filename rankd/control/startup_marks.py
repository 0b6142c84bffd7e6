"""Wall-clock marks of a rank's start-up, for ``bench/bench_kernel.py``'s split of the start-up time.

Only when ``SHARDBOOK_STARTUP_MARKS`` names a file: each mark appends ``rank name unix_time modules
cpu_s`` to it: how many modules the rank has imported so far and the CPU seconds it has used (every
rank of the job appends to the same file; a line is one small write). Otherwise nothing.
Nothing here imports more than the standard library: the marks must not cost what they measure.
"""

from __future__ import annotations

import os
import sys
import time

ENV = "SHARDBOOK_STARTUP_MARKS"


def mark(name: str, at: float | None = None) -> None:
    """Record that this rank reached ``name`` now (or at ``at``, a unix time)."""
    path = os.environ.get(ENV)
    if not path:
        return
    rank = os.environ.get("RANK", "0")
    when = time.time() if at is None else at
    line = f"{rank} {name.replace(' ', '_')} {when:.6f} {len(sys.modules)} {time.process_time():.3f}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, line.encode())
        finally:
            os.close(fd)
    except OSError:
        pass


def mark_process_start() -> None:
    """Record when this process was created (from /proc), before the interpreter itself started.

    The start is in clock ticks since boot; it is placed on the wall clock through ``/proc/uptime``
    (10 ms), not ``btime`` (whole seconds: that put the mark up to 1 s early, moving up to a second
    from the launch to the interpreter in the bench's split).
    """
    if not os.environ.get(ENV):
        return
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime, now = float(f.read().split()[0]), time.time()
        mark("process", now - uptime + start_ticks / os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, IndexError):
        pass
