"""``python -m shardbook.kernel.slurm.node``: the one task srun starts on every node of the job.

It starts torchrun for its node (``--node_rank`` is ``SLURM_NODEID``, static rendezvous on the
allocation's first node): the kernel (or ``shardbook serve``) on node 0, followers elsewhere. It
passes SIGTERM on to torchrun, and watches the lease: once the launcher has not touched it for the
grace period, the ranks stop and node 0 cancels the job (when the job was allocated for them).
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

from shardbook.kernel.slurm.step import CONNECTION_ENV, STEP_ENV, StepPlan
from shardbook.rankd.control.lifetime import LAUNCHER_ENV, die_with_parent

log = logging.getLogger("shardbook.slurm")


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
    command = plan.command if node == 0 else plan.follower_command
    private = Path(tempfile.mkdtemp(prefix="shardbook-slurm-"))
    if node == 0 and CONNECTION_ENV in os.environ:
        connection = private / "kernel.json"
        fd = os.open(connection, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(json.loads(os.environ[CONNECTION_ENV]), f)
        command = [str(connection) if arg == "{connection_file}" else arg for arg in command]
    torchrun = subprocess.Popen(torchrun_argv(plan, node, command), env=env, preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda signum, frame: torchrun.send_signal(signal.SIGTERM))
    lease = LeaseWatch(plan.lease, plan.lease_grace)
    try:
        while True:
            try:
                return torchrun.wait(timeout=1)
            except subprocess.TimeoutExpired:
                pass
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
