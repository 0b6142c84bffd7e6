"""A follower on the other node whose torch fails to import is named by the kernel on node 0 (Slurm, two nodes).

On a real cluster each node has its own /tmp; the note goes to the folder beside the provisioner's lease (the
shared filesystem every node of the job sees), named alike on every node. Before, rank 1 exited 1, srun's
``--kill-on-bad-exit`` ended the step and the kernel died without saying why.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import wait_until
from tests.e2e.test_startup_report import (
    BROKEN_TORCH_CAUSE,
    LoggedKernel,
    assert_reported_at_start,
    break_torch_on_followers,
)
from tests.slurm.cluster import job_processes

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_a_rank_on_the_other_node_whose_torch_fails_is_named_by_the_kernel(slurm_prefix, slurm_cluster, tmp_path):
    path = break_torch_on_followers(tmp_path)
    kernel = LoggedKernel(tmp_path / "server.log", {"OMP_NUM_THREADS": "1", "PYTHONPATH": path}, "slurm2x1")
    try:
        kernel.kc.wait_for_ready(timeout=120)
        job = kernel.km.provisioner.job.jobid
        assert_reported_at_start(kernel, BROKEN_TORCH_CAUSE)
        log = kernel.server_log()
        assert "[shardbook rank 1] ERROR" in log and "did not start within" not in log, log[-3000:]
        assert (tmp_path / "broken" / "torch" / "failed.pid").exists()
    finally:
        kernel.stop()
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=30), slurm_cluster.queue()
    assert wait_until(lambda: not job_processes(job), timeout=20), job_processes(job)
