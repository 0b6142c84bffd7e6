"""``shardbook serve --slurm`` and ``chat --slurm``: allocate, run one srun step, give the nodes back.

The terminal process holds the lease: when it is killed, the ranks stop and the job ends itself
after the grace period. For ``serve``, Ctrl-C and SIGTERM become ``stop`` in the lease file: node 0
passes SIGTERM to rank 0, which stops serving and ends the job; a second Ctrl-C ends the step at once.
For ``chat`` (``interactive``), srun passes this terminal's input to rank 0 and its output back, and
Ctrl-C becomes SIGUSR1 to srun, which passes it to every process of the step; they all ignore it
(``node.py``) except rank 0 of the terminal chat, which takes it as Ctrl-C and decides what it means,
as under ``chat --nproc`` (stop the reply, clear the prompt). SIGTERM and SIGHUP stop it through the lease.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path

from shardbook.kernel.slurm import jobs
from shardbook.kernel.slurm.options import SlurmOptions
from shardbook.kernel.slurm.step import LeaseKeeper, plan_for, srun_argv, step_env


def say(text: str) -> None:
    print(f"shardbook: {text}", file=sys.stderr, flush=True)


REMOTE_TTY_ENV = "SHARDBOOK_REMOTE_TTY"
"""Which of the user's streams are a terminal (``stdin,stdout,stderr``), for a rank 0 that uses them through srun."""


def current_job(options: SlurmOptions, job_name: str) -> jobs.JobInfo:
    if options.jobid:
        info = jobs.job_info(options.jobid)
        if info is None or not info.running:
            raise ValueError(f"--jobid {options.jobid}: " + (info.why() if info else "no such job"))
        return info
    return asyncio.run(jobs.allocate(options, job_name, say))


def remote_tty() -> str:
    streams = {"stdin": sys.stdin, "stdout": sys.stdout, "stderr": sys.stderr}
    return ",".join(name for name, stream in streams.items() if stream.isatty())


def run_in_allocation(options: SlurmOptions, command: list[str], job_name: str, interactive: bool = False) -> int:
    """Run ``python -m torch.distributed.run ... COMMAND`` on every node of an allocation; returns srun's exit code."""
    job = current_job(options, job_name)
    lease = LeaseKeeper(
        Path("~/.shardbook/slurm").expanduser() / f"job-{job.jobid}-{os.getpid()}.lease", options.lease_grace
    )
    srun = None
    try:
        plan = plan_for(job, options, command, command, lease.path)
        say(f"starting {options.label()} ranks in Slurm job {job.jobid}; rank 0 on {job.nodes[0]} ({plan.master_addr})")
        env = step_env(dict(os.environ), plan, options, None)
        env[REMOTE_TTY_ENV] = remote_tty()
        # a session of its own: a terminal's Ctrl-C must not reach srun, which would kill the step at once
        srun = subprocess.Popen(srun_argv(plan, options, interactive), env=env, start_new_session=True)

        def interrupt(signum, frame) -> None:
            srun.send_signal(signal.SIGUSR1)

        def stop(signum, frame) -> None:
            if lease.stopping:
                say("stopping the step now (scancel)")
                jobs.cancel_steps(job.jobid)
                return
            say("stopping: rank 0 stops the reply in flight and ends the job (Ctrl-C again: at once)")
            lease.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, interrupt if interactive and sig == signal.SIGINT else stop)
        code = srun.wait()
    finally:
        if srun is not None and srun.poll() is None:
            srun.terminate()
        lease.stop()
        if options.jobid is None:
            say(f"giving back Slurm job {job.jobid} (scancel)")
            jobs.cancel(job.jobid)
    return 128 - code if code < 0 else code
