"""Process lifetime on Linux: die with the parent or the launcher, and tell whether a local pid runs.

torchrun starts every worker in its own session, so when Jupyter kills torchrun's process group
the workers would survive as orphans. ``die_with_parent`` asks the kernel to send SIGTERM when
torchrun goes away; ``pid_alive`` treats a zombie as dead (torchrun may not have reaped it yet).
When the launcher above torchrun dies (a Jupyter server SIGKILLed or OOM-killed), torchrun lives
on as an orphan; ``exit_with_launcher`` makes every rank on the launcher's node leave then.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import threading
import time

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1
LAUNCHER_ENV = "SHARDBOOK_LAUNCHER_PID"
"""The process whose end ends the job; Jupyter's ``JPY_PARENT_PID`` when unset."""
LAUNCHER_POLL_S = 0.5


def die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask Linux to send ``sig`` when the parent exits; False where prctl is unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        ok = libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False
    if ok and os.getppid() == 1:  # the parent died before prctl took effect
        os.kill(os.getpid(), sig)
    return ok


def pid_alive(pid: int) -> bool:
    """True while ``pid`` runs on this host (a zombie counts as dead)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def launcher_pid() -> int | None:
    """The launcher to watch: ``$SHARDBOOK_LAUNCHER_PID`` or ``$JPY_PARENT_PID``, if it is an ancestor.

    Only an ancestor counts: the variable may have leaked from another environment, and on the
    other nodes of a job the same number names some unrelated process.
    """
    text = os.environ.get(LAUNCHER_ENV) or os.environ.get("JPY_PARENT_PID") or ""
    if not text.isdigit() or int(text) <= 1:
        return None
    pid, ancestor = int(text), os.getppid()
    while ancestor and ancestor > 1:
        if ancestor == pid:
            return pid
        ancestor = parent_of(ancestor)
    return None


def exit_with_launcher(pid: int | None = None) -> bool:
    """Leave this process (exit status 0) as soon as the launcher is gone; False when there is none to watch."""
    pid = launcher_pid() if pid is None else pid
    if pid is None:
        return False

    def watch() -> None:
        while pid_alive(pid):
            time.sleep(LAUNCHER_POLL_S)
        log.warning("pid %d exiting: the process that launched this job (pid %d) is gone", os.getpid(), pid)
        os._exit(0)

    threading.Thread(target=watch, name="shardbook-launcher-watch", daemon=True).start()
    return True
