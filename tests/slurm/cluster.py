"""A real two-node Slurm cluster on this machine, for the Slurm tests: munged, slurmctld, two slurmd.

Both nodes (``n1``, ``n2``) are 127.0.0.1 with their own slurmd port; everything (config, state, logs,
the munge key and socket) lives in one directory. Every daemon runs in the foreground as a child of
this process and is stopped by its pid. Needs root (SlurmUser=root) and Debian's slurm packages.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

DAEMONS = ("munged", "slurmctld", "slurmd", "sinfo", "salloc", "srun", "squeue", "scancel", "scontrol")


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    gone = [d for d in DAEMONS if not shutil.which(d) and not Path("/usr/sbin", d).exists()]
    if gone:
        need = "slurmctld slurmd slurm-client munge"
        return f"slurm is not installed (missing {', '.join(gone)}; .ci/setup installs {need})"
    if os.geteuid() != 0:
        return "the Slurm test cluster runs its daemons as root (SlurmUser=root)"
    return None


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def which(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


def job_processes(job: str) -> list[psutil.Process]:
    """Processes on this machine that belong to Slurm job ``job`` (slurmstepd's tasks carry SLURM_JOB_ID)."""
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if proc.environ().get("SLURM_JOB_ID") == job and proc.pid != os.getpid():
                found.append(proc)
        except (psutil.Error, OSError):
            pass
    return found


CONF = """\
ClusterName=sbtest
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={node_ports[0]}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmUser=root
SlurmdUser=root
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool/%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/log/slurmctld.log
SlurmdLogFile={root}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
ReturnToService=2
InactiveLimit=0
KillWait=3
MinJobAge=300
MessageTimeout=20
SlurmdTimeout=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
PartitionName=held Nodes=ALL MaxTime=INFINITE State=DOWN
"""
NODE = "NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={cpus} RealMemory=1000 State=UNKNOWN"


@dataclass
class Cluster:
    root: Path
    nodes: tuple[str, ...] = ("n1", "n2")
    cpus: int = 2
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf)}

    def write(self) -> None:
        for sub in ("state", "spool", "log", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        for node in self.nodes:
            (self.root / "spool" / node).mkdir(exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + len(self.nodes))
        nodes = "\n".join(NODE.format(name=n, port=p, cpus=self.cpus) for n, p in zip(self.nodes, node_ports))
        self.conf.write_text(CONF.format(root=self.root, ctld_port=ctld_port, node_ports=node_ports, nodes=nodes))
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        os.chmod(self.root / "munge", 0o700)

    def spawn(self, name: str, argv: list[str]) -> None:
        log = open(self.root / "log" / f"{name}.out", "ab")
        self.procs[name] = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
        )

    def start(self, deadline_s: float = 60) -> Cluster:
        self.write()
        m = self.root / "munge"
        self.spawn(
            "munged",
            [
                which("munged"),
                "-F",
                "--force",
                f"--key-file={m}/munge.key",
                f"--socket={m}/munge.socket",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
        )
        self.wait(lambda: (m / "munge.socket").exists(), 10, "munged did not create its socket")
        self.spawn("slurmctld", [which("slurmctld"), "-D", "-i", "-f", str(self.conf)])
        for node in self.nodes:
            self.spawn(f"slurmd-{node}", [which("slurmd"), "-D", "-N", node, "-f", str(self.conf)])
        self.wait(self.all_idle, deadline_s, "the nodes did not become idle")
        return self

    def wait(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            for name, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"{name} exited with {proc.returncode}; logs in {self.root / 'log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{what} within {timeout:.0f} s; logs in {self.root / 'log'}")
            time.sleep(0.3)

    def run(self, *argv: str, check: bool = False) -> str:
        proc = subprocess.run(argv, env=self.env, capture_output=True, text=True, timeout=30, check=check)
        return proc.stdout

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-p", "debug", "-o", "%N %t")
        return dict(line.split() for line in out.splitlines() if line.strip())

    def all_idle(self) -> bool:
        states = self.node_states()
        return sorted(states) == sorted(self.nodes) and all(s == "idle" for s in states.values())

    def queue(self) -> list[str]:
        return self.run("squeue", "-h", "-o", "%i %T %r").splitlines()

    def stop(self) -> None:
        for name in reversed(list(self.procs)):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
