"""Slurm's own commands: ``salloc --no-shell`` (with its pending reasons), ``scontrol show``, ``scancel``.

Everything here calls the Slurm client commands on PATH (``SLURM_CONF`` picks the cluster); nothing
links against Slurm. ``allocate`` is async so that a Jupyter server's event loop keeps running while a
request is pending.
"""

from __future__ import annotations

import asyncio
import re
import socket
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from shardbook.kernel.slurm.options import SlurmOptions
from shardbook.rankd.control.lifetime import die_with_parent

ENDED = (
    "COMPLETED",
    "CANCELLED",
    "FAILED",
    "TIMEOUT",
    "NODE_FAIL",
    "PREEMPTED",
    "BOOT_FAIL",
    "DEADLINE",
    "OUT_OF_MEMORY",
)
_JOB_LINE = re.compile(r"(?:Pending|Granted) job allocation (\d+)")


class AllocationError(RuntimeError):
    """The allocation was refused, failed, or stayed pending too long (the request is cancelled then)."""


@dataclass
class JobInfo:
    jobid: str
    state: str
    reason: str
    nodes: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    pending_reasons: list[str] = field(default_factory=list)
    """Slurm's reasons while this request was pending, in order (empty: it started at once, or was given)."""
    waited_s: float = 0.0

    @property
    def running(self) -> bool:
        return self.state == "RUNNING"

    @property
    def ended(self) -> bool:
        return self.state in ENDED

    def why(self) -> str:
        reason = "" if self.reason in ("None", "") else f", reason {self.reason}"
        return f"Slurm job {self.jobid} is {self.state}{reason}"

    def queue_note(self) -> str:
        """One line for the user once the ranks run: how long the job pended and why, and where it runs."""
        where = f"Slurm job {self.jobid} on {','.join(self.nodes)}"
        if not self.pending_reasons:
            return where
        reasons = ", then ".join(self.pending_reasons)
        return f"waited {duration_text(self.waited_s)} in Slurm's queue ({reasons}); {where}"


def duration_text(seconds: float) -> str:
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes} min {secs} s" if minutes else f"{secs} s"


def slurm(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout)


def parse_fields(line: str) -> dict[str, str]:
    """``Key=Value Key=Value ...`` of ``scontrol show -o`` (a value may not hold spaces, except the last)."""
    found, key = {}, None
    for token in line.split():
        name, sep, value = token.partition("=")
        if sep and name.replace("/", "").replace(":", "").isalnum():
            key, found[name] = name, value
        elif key:
            found[key] += " " + token
    return found


def hostnames(nodelist: str) -> list[str]:
    if not nodelist or nodelist in ("(null)", "None"):
        return []
    return slurm("scontrol", "show", "hostnames", nodelist).stdout.split()


def job_info(jobid: str) -> JobInfo | None:
    """The job as slurmctld knows it, or None once it has forgotten it (``MinJobAge`` after the end)."""
    proc = slurm("scontrol", "show", "job", "-o", str(jobid))
    if proc.returncode != 0 or not proc.stdout.strip():
        return None
    f = parse_fields(proc.stdout.splitlines()[0])
    return JobInfo(str(jobid), f.get("JobState", "?"), f.get("Reason", "None"), hostnames(f.get("NodeList", "")), f)


def node_address(node: str) -> str:
    """The IP address of a node (its ``NodeAddr``), for the connection file and torchrun's rendezvous."""
    f = parse_fields(slurm("scontrol", "show", "node", "-o", node).stdout)
    return socket.gethostbyname(f.get("NodeAddr") or node)


def cancel(jobid: str, signal: str | None = None) -> None:
    slurm("scancel", *([f"--signal={signal}"] if signal else []), str(jobid))


def steps(jobid: str) -> list[str]:
    out = slurm("squeue", "-h", "-s", "-j", str(jobid), "-o", "%i").stdout.split()
    return [s for s in out if s.split(".")[-1].isdigit()]


def cancel_steps(jobid: str) -> None:
    """End the job's steps (the ranks), keeping the allocation."""
    for step in steps(jobid):
        slurm("scancel", step)


class _Salloc:
    """``salloc --no-shell`` in the background, its stderr read line by line for the job id."""

    def __init__(self, options: SlurmOptions, name: str, env: dict[str, str] | None):
        argv = ["salloc", "--no-shell", f"--job-name={name}", *options.salloc_args()]
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, preexec_fn=die_with_parent
        )
        self.jobid: str | None = None
        self.lines: list[str] = []
        threading.Thread(target=self._read, daemon=True, name="shardbook-salloc").start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line.rstrip())
            match = _JOB_LINE.search(line)
            if match:
                self.jobid = match.group(1)

    def output(self) -> str:
        return "\n".join(self.lines[-5:])


async def allocate(
    options: SlurmOptions, name: str, say: Callable[[str], None], env: dict[str, str] | None = None
) -> JobInfo:
    """Request the nodes and wait until the job runs, saying why while it is pending.

    Past ``options.pending_timeout`` the request is cancelled and AllocationError names the last reason.
    """
    salloc = _Salloc(options, name, env)
    started = time.monotonic()
    deadline = started + options.pending_timeout
    reasons: list[str] = []
    say(f"requesting {options.label()} from Slurm: salloc {' '.join(options.salloc_args())}")
    try:
        while True:
            await asyncio.sleep(0.5)
            info = await asyncio.to_thread(job_info, salloc.jobid) if salloc.jobid else None
            if info is not None and info.running and info.nodes:
                say(f"Slurm job {info.jobid} runs on {','.join(info.nodes)}")
                await asyncio.to_thread(_reap, salloc.proc)
                info.pending_reasons, info.waited_s = reasons, time.monotonic() - started
                return info
            if info is not None and info.state == "PENDING" and info.reason not in ("None", "", *reasons[-1:]):
                reasons.append(info.reason)
                say(f"Slurm job {info.jobid} is pending: {info.reason} (waiting up to {options.pending_timeout:.0f} s)")
            if info is not None and info.ended:
                raise AllocationError(f"{info.why()} before it started; salloc said:\n{salloc.output()}")
            if salloc.proc.poll() not in (None, 0):
                await asyncio.sleep(0.2)  # the last stderr lines
                raise AllocationError(f"salloc failed (exit {salloc.proc.returncode}):\n{salloc.output()}")
            if time.monotonic() > deadline:
                reason = f" (reason {', then '.join(reasons)})" if reasons else ""
                raise AllocationError(
                    f"Slurm job {salloc.jobid or '?'} was still pending{reason} after {options.pending_timeout:.0f} s; "
                    "the request was cancelled. Ask for fewer nodes, another partition, or a longer --pending-timeout"
                )
    except BaseException:
        if salloc.jobid:
            await asyncio.to_thread(cancel, salloc.jobid)
        if salloc.proc.poll() is None:
            salloc.proc.terminate()
        raise


def _reap(proc: subprocess.Popen) -> None:
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
