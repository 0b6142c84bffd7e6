"""Allocations that never start, jobs that end under the kernel, and a Jupyter side that is killed."""

from __future__ import annotations

import logging
import signal
import subprocess
import sys
import time

import pytest
from jupyter_client.manager import KernelManager

from shardbook.kernel.slurm.jobs import AllocationError
from tests.e2e.conftest import KernelHandle, wait_until
from tests.slurm.cluster import job_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_pending_allocation_says_why_then_times_out_and_leaves_nothing_queued(slurm_prefix, slurm_cluster, caplog):
    caplog.set_level(logging.INFO)
    km = KernelManager(kernel_name="slurm-held-short")
    started = time.monotonic()
    with pytest.raises(AllocationError, match=r"still pending \(reason PartitionDown\) after 6 s"):
        km.start_kernel()
    assert time.monotonic() - started < 30
    assert "is pending: PartitionDown" in caplog.text
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=15), slurm_cluster.queue()


def test_scancel_from_outside_makes_the_kernel_dead_with_slurms_reason(slurm_prefix, slurm_cluster, caplog):
    caplog.set_level(logging.INFO)
    handle = KernelHandle("slurm2x1", env={"OMP_NUM_THREADS": "1"})
    try:
        job = handle.km.provisioner.job.jobid
        assert handle.run("1 + 1").status == "ok"
        subprocess.run(["scancel", job], check=True, env=slurm_cluster.env)
        assert wait_until(lambda: not handle.km.is_alive(), timeout=30)
        assert f"Slurm job {job} is CANCELLED" in caplog.text
        assert wait_until(lambda: not job_processes(job), timeout=30), job_processes(job)
    finally:
        handle.kc.stop_channels()
        handle.km.cleanup_resources()
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=15), slurm_cluster.queue()


MANAGER = """
import sys, time
from jupyter_client.manager import KernelManager
km = KernelManager(kernel_name="slurm2x1")
km.start_kernel()
kc = km.client(); kc.start_channels(); kc.wait_for_ready(timeout=120)
print("JOB", km.provisioner.job.jobid, flush=True)
time.sleep(600)
"""


def test_a_killed_kernel_manager_leaves_no_job_after_the_grace_period(slurm_prefix, slurm_cluster):
    manager = subprocess.Popen([sys.executable, "-c", MANAGER], stdout=subprocess.PIPE, text=True)
    try:
        job = next((line.split()[1] for line in manager.stdout if line.startswith("JOB ")), "")
        assert job.isdigit(), "the kernel did not start"
        assert any(line.startswith(f"{job} RUNNING") for line in slurm_cluster.queue())
        manager.send_signal(signal.SIGKILL)
        manager.wait()
        killed = time.monotonic()
        assert wait_until(lambda: not slurm_cluster.queue(), timeout=60), slurm_cluster.queue()
        assert time.monotonic() - killed < 8 + 20  # the grace period (--lease-grace 8) and a few polls
        assert wait_until(lambda: not job_processes(job), timeout=20), job_processes(job)
    finally:
        manager.kill()
