"""One ``srun`` step for the whole job: the plan every node reads, srun's argv, and the lease.

The plan (``SHARDBOOK_SLURM_STEP``, JSON) and the control-plane key (``SHARDBOOK_KEY``) reach the
nodes through srun's environment, never a command line; so does the kernel's connection file
(``SHARDBOOK_SLURM_CONNECTION``), which node 0 writes to a private file. The lease is a file the
launcher touches every few seconds; every node watches it, and once it has gone stale for the grace
period the ranks stop and node 0 cancels the job (a killed Jupyter server leaves nothing running).
``stop`` written into the lease asks node 0 to stop rank 0 gracefully (Ctrl-C of ``shardbook serve --slurm``):
a Slurm signal would reach every process of the step, torchrun included, which then reports a failure.
"""

from __future__ import annotations

import json
import os
import random
import secrets
import socket
import sys
import threading
from dataclasses import asdict, dataclass
from pathlib import Path

from shardbook.kernel.slurm.jobs import JobInfo, node_address
from shardbook.kernel.slurm.options import SlurmOptions
from shardbook.rankd.control import protocol

STEP_ENV = "SHARDBOOK_SLURM_STEP"
CONNECTION_ENV = "SHARDBOOK_SLURM_CONNECTION"


@dataclass
class StepPlan:
    jobid: str
    nnodes: int
    nproc: int
    master_addr: str
    master_port: int
    command: list[str]
    """What node 0 runs under torchrun (``-m shardbook.kernel -f {connection_file}``)."""
    follower_command: list[str]
    lease: str | None
    lease_grace: float
    own_job: bool
    """True when the allocation was made for this job, so the job may cancel it when its lease expires."""
    note: str = ""
    """``JobInfo.queue_note``: what the ranks tell the user once they run (``SLURM_NOTE_ENV``)."""

    @classmethod
    def from_env(cls, env: dict[str, str]) -> StepPlan:
        return cls(**json.loads(env[STEP_ENV]))


def free_port_on(address: str, taken: set[int] | frozenset[int] = frozenset()) -> int:
    """A free port when the address is this machine's, else a random one in a range torch users use; never one of
    `taken` (ports already handed out but not bound yet: the OS may offer a closed probe's port again, and the
    rendezvous store and a kernel socket then collide)."""
    while True:
        try:
            with socket.socket() as s:
                s.bind((address, 0))
                port = s.getsockname()[1]
        except OSError:
            port = random.randint(29500, 39999)
        if port not in taken:
            return port


def plan_for(
    job: JobInfo, options: SlurmOptions, command: list[str], follower_command: list[str], lease: Path | None
) -> StepPlan:
    if len(job.nodes) < options.nodes:
        raise RuntimeError(f"Slurm job {job.jobid} has {len(job.nodes)} nodes, the kernel needs {options.nodes}")
    addr = node_address(job.nodes[0])
    return StepPlan(
        jobid=job.jobid,
        nnodes=options.nodes,
        nproc=options.ntasks_per_node,
        master_addr=addr,
        master_port=free_port_on(addr),
        command=command,
        follower_command=follower_command,
        lease=str(lease) if lease else None,
        lease_grace=options.lease_grace,
        own_job=options.jobid is None,
        note=job.queue_note(),
    )


def srun_argv(plan: StepPlan, options: SlurmOptions, interactive: bool = False) -> list[str]:
    """One task per node, each holding the whole node's share of the job; torchrun starts the ranks.

    ``interactive`` (``shardbook chat --slurm``): srun's stdin goes to node 0 alone (so to rank 0), and output is
    passed on as it comes, not a line at a time (a reply streams, the prompt shows before its line ends).
    """
    io = ["--input=0", "--unbuffered"] if interactive else []
    gres = [f"--gres={options.gres}"] if options.gres else []
    gres += [f"--gpus-per-node={options.gpus_per_node}"] if options.gpus_per_node else []
    return [
        "srun",
        f"--jobid={plan.jobid}",
        f"--nodes={plan.nnodes}",
        f"--ntasks={plan.nnodes}",
        "--ntasks-per-node=1",
        f"--cpus-per-task={options.ntasks_per_node}",
        *gres,
        "--kill-on-bad-exit=1",
        "--job-name=shardbook-ranks",
        "--export=ALL",
        *io,
        sys.executable,
        "-m",
        "shardbook.kernel.slurm.node",
    ]


def step_env(base: dict[str, str], plan: StepPlan, options: SlurmOptions, connection: dict | None) -> dict[str, str]:
    """srun's environment: the launcher's, less its own Slurm job's variables, plus the plan and a fresh key."""
    env = {k: v for k, v in base.items() if not k.startswith(("SLURM_", "SALLOC_", "SBATCH_", "SRUN_"))}
    if "SLURM_CONF" in base:
        env["SLURM_CONF"] = base["SLURM_CONF"]
    env.update(options.env)
    if options.device:
        env["SHARDBOOK_DEVICE"] = options.device
    env.pop(protocol.KEY_FILE_ENV, None)
    env[protocol.KEY_ENV] = secrets.token_hex(32)
    env[STEP_ENV] = json.dumps(asdict(plan))
    if connection is not None:
        env[CONNECTION_ENV] = json.dumps({k: v.decode() if isinstance(v, bytes) else v for k, v in connection.items()})
    return env


class LeaseKeeper:
    """Touch the lease file every ``grace / 4`` seconds (at least every 5 s) until stopped."""

    def __init__(self, path: Path, grace: float):
        self.path, self.interval = path, max(0.5, min(5.0, grace / 4))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self._stop = threading.Event()
        self.stopping = False
        threading.Thread(target=self._run, daemon=True, name="shardbook-slurm-lease").start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                self.path.touch()

    def request_stop(self) -> None:
        """Ask node 0 to stop rank 0 gracefully (``stop`` in the file; the nodes read it every second)."""
        self.stopping = True
        self.path.write_text("stop\n")

    def stop(self, remove: bool = True) -> None:
        self._stop.set()
        if remove:
            self.path.unlink(missing_ok=True)
