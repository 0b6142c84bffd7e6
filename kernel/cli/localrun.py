"""Start a one-node job's ranks without torchrun: ``python -m shardbook.kernel.cli.localrun --nproc N -m MODULE``.

torchrun imports torch (1.7 s on a quiet machine) before it starts any rank, and rank 0 then
imports it again: in series, that was the largest part of a kernel's start-up. For one node
torchrun's job is small, and this module does it with the standard library only:

- every rank gets torchrun's environment (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
  ``LOCAL_WORLD_SIZE``, ``GROUP_RANK``, ``MASTER_ADDR``/``MASTER_PORT`` on a free loopback port,
  the ``TORCHELASTIC_*`` ids) and runs in a session of its own, as under torchrun;
- when a rank fails (non-zero exit, or a signal) the others get SIGTERM, then SIGKILL after
  :data:`STOP_GRACE_S`; the exit status is the first failed rank's (128 + N for signal N, which is
  also named in one line);
- SIGTERM, SIGINT and SIGHUP sent to this process go to every rank (exit status 128 + N).

Several nodes and Slurm keep torchrun (its rendezvous across hosts is the part worth having).
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

STOP_GRACE_S = 30.0
"""How long the other ranks may take to end after SIGTERM before they get SIGKILL (torchrun's default)."""
FORWARDED_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


PORTS_BELOW_EPHEMERAL = 10_000
"""How many ports under the ephemeral range the store's port is drawn from."""


def free_port() -> int:
    """A free loopback port under the system's ephemeral range, for rank 0's store.

    Rank 0 binds it seconds after it is picked (after its imports). A port from the ephemeral
    range (binding port 0) can be taken in between by any outgoing connection on the machine, and
    by every other program that picks ports that way (Jupyter's own): one kernel start in five
    failed with EADDRINUSE while five kernels and their clients ran on this machine. Under that
    range, only a program that binds this very port can take it.
    """
    low = ephemeral_range_start()
    candidates = range(max(1024, low - PORTS_BELOW_EPHEMERAL), low)
    for port in random.sample(candidates, min(64, len(candidates))):
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # every one taken: the ephemeral range, as before
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ephemeral_range_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default


def rank_env(rank: int, nproc: int, port: int, run_id: str) -> dict[str, str]:
    """What torchrun's environment gives rank ``rank`` of a one-node job of ``nproc`` ranks."""
    env = dict(os.environ)
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # torchrun's default: ranks must not each take every core
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        ROLE_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        ROLE_WORLD_SIZE=str(nproc),
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="False",  # rank 0 hosts the store
    )
    return env


class Ranks:
    """The ranks' processes, watched until every one has ended."""

    def __init__(self, command: list[str], nproc: int):
        port, run_id = free_port(), uuid.uuid4().hex
        self.procs = [
            subprocess.Popen(command, env=rank_env(r, nproc, port, run_id), start_new_session=True)
            for r in range(nproc)
        ]
        self.stopping_since: float | None = None
        self.signalled: int | None = None
        """The signal this process got and passed on, if any: the ranks' ends are then no failure to report."""

    def pass_on(self, sig: int) -> None:
        self.signalled = sig
        self.stop(sig)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to every rank still running; SIGKILL follows after the grace period."""
        if self.stopping_since is None:
            self.stopping_since = time.monotonic()
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(sig)

    def wait(self) -> int:
        """Block until every rank has ended; the first failure's exit status (0 when none failed)."""
        failed: tuple[int, int] | None = None
        while any(p.returncode is None for p in self.procs):
            for rank, p in enumerate(self.procs):
                if p.returncode is None and p.poll() is not None and p.returncode != 0 and failed is None:
                    failed = (rank, p.returncode)
                    self.stop()
            if self.stopping_since is not None and time.monotonic() - self.stopping_since > STOP_GRACE_S:
                self.stop(signal.SIGKILL)
            time.sleep(0.05)
        if self.signalled is not None:
            return 128 + self.signalled
        return 0 if failed is None else exit_status(*failed)


def exit_status(rank: int, returncode: int) -> int:
    """A failed rank's exit status as a shell gives it; a rank ended by a signal is named in one line."""
    if returncode > 0:
        return returncode
    name = signal.Signals(-returncode).name
    print(f"shardbook: rank {rank} was ended by {name}", file=sys.stderr)
    return 128 - returncode


def parse(argv: list[str]) -> tuple[int, list[str]]:
    """``--nproc N -m MODULE ARGS...`` -> (N, the ranks' command)."""
    if len(argv) < 4 or argv[0] != "--nproc" or not argv[1].isdigit() or int(argv[1]) < 1 or argv[2] != "-m":
        raise SystemExit("usage: python -m shardbook.kernel.cli.localrun --nproc N -m MODULE [ARGS...]")
    return int(argv[1]), [sys.executable, *argv[2:]]


def main(argv: list[str]) -> int:
    nproc, command = parse(argv)
    ranks = Ranks(command, nproc)
    for sig in FORWARDED_SIGNALS:
        signal.signal(sig, lambda signum, frame: ranks.pass_on(signum))
    return ranks.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
