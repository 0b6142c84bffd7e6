"""``shardbook serve --slurm``: the demo model on two Slurm nodes answers the openai client; the nodes go back."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest

from tests.e2e.conftest import wait_until
from tests.e2e.http_helpers import assert_demo_model_replies, wait_for_health

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_serve_on_two_slurm_nodes_answers_the_openai_client(slurm_cluster):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    argv = [sys.executable, "-m", "shardbook.kernel.cli.main", "serve", "--slurm", "--nodes", "2"]
    argv += ["--ntasks-per-node", "1", "--port", str(port), "configs/smollm2-135m.yaml"]
    env = {**slurm_cluster.env, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(argv, env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_for_health(f"http://127.0.0.1:{port}", timeout=180)
        assert any(line.split()[1] == "RUNNING" for line in slurm_cluster.queue())
        assert_demo_model_replies(f"http://127.0.0.1:{port}/v1")
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, proc.stderr.read()
        assert "giving back Slurm job" in proc.stderr.read()
    finally:
        proc.kill()
    assert wait_until(lambda: not slurm_cluster.queue(), timeout=20), slurm_cluster.queue()
