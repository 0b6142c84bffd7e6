"""A shardbook kernel on a real Slurm allocation, started through jupyter_client's KernelManager and the
``shardbook-slurm`` provisioner (two nodes, n1 and n2, of the session's test cluster)."""

from __future__ import annotations

import logging
import subprocess
import time

import pytest

from tests.driver import interrupt_when
from tests.e2e.conftest import KernelHandle, wait_until
from tests.slurm.cluster import job_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def dist_rows(handle) -> list[list[str]]:
    table = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    return [line.split() for line in table.split("\n\n")[0].splitlines()]  # the table, without the job's note


def job_of(handle) -> str:
    return handle.km.provisioner.job.jobid


def test_two_nodes_dist_chat_interrupt_restart_shutdown(slurm_prefix, slurm_cluster):
    handle = KernelHandle("slurm2x1", env={"OMP_NUM_THREADS": "1"})
    try:
        job = job_of(handle)
        rows = dist_rows(handle)
        assert rows[0][:3] == ["rank", "host", "slurm"], rows
        assert [r[2:5] for r in rows[1:]] == [["n1", "job", job], ["n2", "job", job]], rows
        ex = handle.run("%load_sharded configs/smollm2-135m.yaml", timeout=240)
        assert ex.status == "ok", ex.error_text() + ex.stderr()
        ex = handle.run("%%chat --output text --max-new-tokens 16\nWhat is the capital of France?", timeout=120)
        assert ex.status == "ok" and "Paris" in ex.stdout(), ex.stdout() + ex.stderr()
        ex, seconds = interrupt_when(
            handle,
            "%%chat --new --output text --max-new-tokens 400\nWrite a long story about a lighthouse.",
            lambda m: m["header"]["msg_type"] == "stream",
            timeout=120,
        )
        assert seconds < 10 and ex.status in ("ok", "error"), ex.stderr()
        assert "interrupted]" in ex.stdout() and "generated" in ex.stdout(), ex.stdout() + ex.stderr()
        handle.kc.stop_channels()
        handle.km.restart_kernel(now=False)
        handle.kc = handle.km.client()
        handle.kc.start_channels()
        handle.kc.wait_for_ready(timeout=120)
        assert job_of(handle) == job
        assert [r[4] for r in dist_rows(handle)[1:]] == [job, job]
    finally:
        handle.stop()
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=30), slurm_cluster.queue()
    assert wait_until(lambda: not job_processes(job), timeout=20), job_processes(job)


def test_two_nodes_of_two_ranks_until_the_time_limit_kills_the_kernel(slurm_prefix, slurm_cluster, caplog):
    """The job's time limit ends it: a dead kernel, with Slurm's TIMEOUT. The end time is moved to 2 s from now
    (``TimeLimit=1``, Slurm's least limit, would count a whole minute from the job's start)."""
    caplog.set_level(logging.INFO)
    handle = KernelHandle("slurm2x2", env={"OMP_NUM_THREADS": "1"})
    try:
        job = job_of(handle)
        rows = dist_rows(handle)[1:]
        assert [(r[0], r[2], r[4], r[8]) for r in rows] == [
            ("0", "n1", job, "idle"),
            ("1", "n1", job, "idle"),
            ("2", "n2", job, "idle"),
            ("3", "n2", job, "idle"),
        ], rows
        ex = handle.run("%%all\nimport os\nprint(os.environ['SLURMD_NODENAME'], os.environ['LOCAL_RANK'])")
        assert ex.status == "ok", ex.error_text()
        assert "[rank 3]\nn2 1" in ex.stdout(), ex.stdout()
        end = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(time.time() + 2))  # slurmctld's clock and zone
        subprocess.run(["scontrol", "update", f"JobId={job}", f"EndTime={end}"], check=True, env=slurm_cluster.env)
        assert wait_until(lambda: not handle.km.is_alive(), timeout=120)  # slurmctld checks limits every ~30 s
        assert f"Slurm job {job} is TIMEOUT" in caplog.text
    finally:
        if handle.km.is_alive():
            handle.stop()
        else:
            handle.kc.stop_channels()
            handle.km.cleanup_resources()
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=30), slurm_cluster.queue()
    assert wait_until(lambda: not job_processes(job), timeout=20), job_processes(job)
