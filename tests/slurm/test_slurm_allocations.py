"""A kernel whose job waited in Slurm's queue says so once it runs; a kernel on an allocation the user holds
(``--jobid``) leaves it running."""

from __future__ import annotations

import re
import subprocess
import threading

import pytest

from tests.e2e.conftest import KernelHandle, wait_until
from tests.slurm.cluster import job_processes
from tests.slurm.conftest import install_slurm_spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
NOTE = re.compile(r"waited \d+ s in Slurm's queue \(PartitionDown\); Slurm job (\d+) on n[12]")


def set_held_partition(cluster, state: str) -> None:
    subprocess.run(["scontrol", "update", "PartitionName=held", f"State={state}"], check=True, env=cluster.env)


def test_a_job_that_waited_says_why_in_the_banner_the_first_cell_and_dist(slurm_prefix, slurm_cluster):
    started: dict[str, object] = {}

    def start() -> None:
        try:
            started["handle"] = KernelHandle("slurm-held", env={"OMP_NUM_THREADS": "1"})
        except BaseException as e:
            started["error"] = e

    thread = threading.Thread(target=start, daemon=True)
    thread.start()
    try:
        assert wait_until(
            lambda: any(line.endswith("PENDING PartitionDown") for line in slurm_cluster.queue()), timeout=30
        )
        set_held_partition(slurm_cluster, "UP")
        thread.join(180)
    finally:
        set_held_partition(slurm_cluster, "DOWN")
    handle = started.get("handle")
    assert handle is not None, started.get("error")
    try:
        first = handle.run("1 + 1")
        match = NOTE.search(first.stderr())
        assert first.status == "ok" and match, first.stderr()
        job = match.group(1)
        assert NOTE.search(handle.kc.kernel_info(reply=True)["content"]["banner"])
        assert not NOTE.search(handle.run("2 + 2").stderr()), "the note belongs to the first cell only"
        table = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert NOTE.search(table), table
    finally:
        handle.stop()
    assert wait_until(lambda: not job_processes(job), timeout=30), job_processes(job)


def test_a_kernel_on_a_given_jobid_runs_restarts_in_it_and_leaves_it_running(slurm_prefix, slurm_cluster):
    salloc = subprocess.run(
        ["salloc", "--no-shell", "--nodes", "2", "--job-name", "mine"],
        env=slurm_cluster.env, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    job = re.search(r"Granted job allocation (\d+)", salloc.stderr).group(1)
    try:
        install_slurm_spec(slurm_prefix, "slurm-jobid", "--nodes", "2", "--ntasks-per-node", "1", "--jobid", job)
        handle = KernelHandle("slurm-jobid", env={"OMP_NUM_THREADS": "1"})
        try:
            where = "import os; print(os.environ['SLURM_JOB_ID'])"
            assert handle.run(where).stdout().strip() == job
            handle.kc.stop_channels()
            handle.km.restart_kernel(now=False)
            handle.kc = handle.km.client()
            handle.kc.start_channels()
            handle.kc.wait_for_ready(timeout=120)
            assert handle.run(where).stdout().strip() == job
        finally:
            handle.stop()
        assert wait_until(lambda: not job_processes(job), timeout=30), job_processes(job)
        assert f"{job} RUNNING None" in slurm_cluster.queue(), slurm_cluster.queue()
    finally:
        subprocess.run(["scancel", job], env=slurm_cluster.env, check=True)
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=20), slurm_cluster.queue()
