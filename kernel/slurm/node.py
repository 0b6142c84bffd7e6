"""``python -m shardbook.kernel.slurm.node``: the one task srun starts on every node of the job.

It starts torchrun for its node (``--node_rank`` is ``SLURM_NODEID``, static rendezvous on the
allocation's first node): the kernel (or ``shardbook serve``) on node 0, followers elsewhere, every rank
told where a start-up failure leaves its note (beside the lease, which every node sees). It
passes SIGTERM on to rank 0 (which ends the job), starts the ranks ignoring SIGUSR1 (``chat --slurm``'s
Ctrl-C, which reaches every process of the step; rank 0 of the chat alone takes it), and watches the
lease: once the launcher has not touched it for the grace period, the ranks stop and node 0 cancels
the job (when the job was allocated for them).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from shardbook.kernel.slurm.step import CONNECTION_ENV, STEP_ENV, StepPlan
from shardbook.rankd.control.lifetime import LAUNCHER_ENV, die_with_parent
from shardbook.rankd.control.startup_notes import NOTES_ENV
from shardbook.rankd.control.world import SLURM_NOTE_ENV

log = logging.getLogger("shardbook.slurm")
STOP_GRACE_S = 30.0
"""After SIGTERM, how long the ranks may take to end by themselves before torchrun is told to stop them."""


class LeaseWatch:
    """Stale once the file's mtime has not changed for ``grace`` seconds of this node's clock (no clock skew)."""

    def __init__(self, path: str | None, grace: float):
        self.path, self.grace = Path(path) if path else None, grace
        self.mtime = self._mtime()
        self.changed = time.monotonic()
        if self.path is not None and self.mtime is None:
            log.warning("lease %s is not visible on this node (no shared filesystem?): not watched", self.path)
            self.path = None

    def _mtime(self) -> float | None:
        try:
            return self.path.stat().st_mtime if self.path else None
        except FileNotFoundError:
            return None

    def expired(self) -> bool:
        if self.path is None:
            return False
        mtime = self._mtime()
        if mtime != self.mtime:
            self.mtime, self.changed = mtime, time.monotonic()
        return mtime is None or time.monotonic() - self.changed > self.grace

    def stop_requested(self) -> bool:
        try:
            return self.path is not None and self.path.read_text().startswith("stop")
        except OSError:
            return False


def rank0_of(torchrun_pid: int) -> psutil.Process | None:
    """The worker with ``LOCAL_RANK=0`` under this node's torchrun (rank 0 on node 0)."""
    try:
        children = psutil.Process(torchrun_pid).children()
    except psutil.Error:
        return None
    for child in children:
        try:
            if child.environ().get("LOCAL_RANK") == "0":
                return child
        except psutil.Error:
            pass
    return None


def torchrun_argv(plan: StepPlan, node: int, command: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        *("--nnodes", str(plan.nnodes), "--node_rank", str(node), "--nproc_per_node", str(plan.nproc)),
        *("--master_addr", plan.master_addr, "--master_port", str(plan.master_port)),
        *command,
    ]


def main() -> int:
    node = int(os.environ["SLURM_NODEID"])
    logging.basicConfig(level=logging.INFO, format=f"[shardbook slurm node {node}] %(message)s", stream=sys.stderr)
    plan = StepPlan.from_env(os.environ)
    env = {k: v for k, v in os.environ.items() if k not in (STEP_ENV, CONNECTION_ENV)}
    env[LAUNCHER_ENV] = str(os.getpid())
    env[SLURM_NOTE_ENV] = plan.note
    lease = LeaseWatch(plan.lease, plan.lease_grace)
    if lease.path is not None:  # seen here, so on a shared filesystem: start-up notes reach rank 0 from any node
        env[NOTES_ENV] = str(lease.path.parent / "shardbook-startup")
    command = plan.command if node == 0 else plan.follower_command
    private = Path(tempfile.mkdtemp(prefix="shardbook-slurm-"))
    if node == 0 and CONNECTION_ENV in os.environ:
        connection = private / "kernel.json"
        fd = os.open(connection, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(json.loads(os.environ[CONNECTION_ENV]), f)
        command = [str(connection) if arg == "{connection_file}" else arg for arg in command]
    # srun passes SIGUSR1 (Ctrl-C of `chat --slurm`) to every process of the step: all ignore it (the disposition is
    # inherited) except rank 0 of the terminal chat, which takes it as Ctrl-C
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    torchrun = subprocess.Popen(torchrun_argv(plan, node, command), env=env, preexec_fn=die_with_parent)
    stopping: list[float] = []

    def stop(signum, frame) -> None:
        """Node 0: rank 0 ends the job itself (``shardbook serve`` stops its reply, tells the followers to leave)."""
        stopping.append(time.monotonic())
        rank0 = rank0_of(torchrun.pid) if node == 0 else None
        if rank0 is not None:
            rank0.send_signal(signal.SIGTERM)
        elif node == 0:
            torchrun.send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, stop)
    try:
        while True:
            try:
                return torchrun.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
            if not stopping and lease.stop_requested():
                stop(signal.SIGTERM, None)
            if stopping and time.monotonic() - stopping[0] > STOP_GRACE_S:
                torchrun.terminate()
            if lease.expired():
                log.warning(
                    "lease %s not renewed for %.0f s: the launcher is gone; ending the job", lease.path, lease.grace
                )
                torchrun.terminate()
                try:
                    torchrun.wait(15)
                except subprocess.TimeoutExpired:
                    torchrun.kill()
                if node == 0 and plan.own_job:
                    subprocess.run(["scancel", plan.jobid], timeout=30)
                return 1
    finally:
        shutil.rmtree(private, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
