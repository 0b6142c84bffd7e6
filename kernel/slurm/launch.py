"""``shardbook serve --slurm`` (and any terminal command): allocate, run one srun step, give the nodes back.

The terminal process holds the lease: when it is killed, the ranks stop and the job ends itself
after the grace period. Ctrl-C and SIGTERM become ``stop`` in the lease file: node 0 passes SIGTERM to
rank 0, which stops serving and ends the job; a second Ctrl-C ends the step at once.
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


def current_job(options: SlurmOptions) -> jobs.JobInfo:
    if options.jobid:
        info = jobs.job_info(options.jobid)
        if info is None or not info.running:
            raise ValueError(f"--jobid {options.jobid}: " + (info.why() if info else "no such job"))
        return info
    return asyncio.run(jobs.allocate(options, "shardbook-serve", say))


def run_in_allocation(options: SlurmOptions, command: list[str]) -> int:
    """Run ``python -m torch.distributed.run ... COMMAND`` on every node of an allocation; returns srun's exit code."""
    job = current_job(options)
    lease = LeaseKeeper(
        Path("~/.shardbook/slurm").expanduser() / f"job-{job.jobid}-{os.getpid()}.lease", options.lease_grace
    )
    srun = None
    try:
        plan = plan_for(job, options, command, command, lease.path)
        say(f"starting {options.label()} ranks in Slurm job {job.jobid}; rank 0 on {job.nodes[0]} ({plan.master_addr})")
        env = step_env(dict(os.environ), plan, options, None)
        # a session of its own: a terminal's Ctrl-C must not reach srun, which would kill the step at once
        srun = subprocess.Popen(srun_argv(plan, options), env=env, start_new_session=True)

        def stop(signum, frame) -> None:
            if lease.stopping:
                say("stopping the step now (scancel)")
                jobs.cancel_steps(job.jobid)
                return
            say("stopping: rank 0 stops the reply in flight and ends the job (Ctrl-C again: at once)")
            lease.request_stop()

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, stop)
        code = srun.wait()
    finally:
        if srun is not None and srun.poll() is None:
            srun.terminate()
        lease.stop()
        if options.jobid is None:
            say(f"giving back Slurm job {job.jobid} (scancel)")
            jobs.cancel(job.jobid)
    return 128 - code if code < 0 else code
