"""Process lifetime on Linux: die with the parent, and tell whether a local pid still runs.

torchrun starts every worker in its own session, so when Jupyter kills torchrun's process group
the workers would survive as orphans. ``die_with_parent`` asks the kernel to send SIGTERM when
torchrun goes away; ``pid_alive`` treats a zombie as dead (torchrun may not have reaped it yet).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal

log = logging.getLogger(__name__)
PR_SET_PDEATHSIG = 1


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
