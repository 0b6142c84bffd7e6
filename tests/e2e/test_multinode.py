"""Two torchrun launches on loopback: node 0 holds the kernel, node 1 only followers."""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from tests.e2e.conftest import KernelHandle, install_spec, wait_until

pytestmark = pytest.mark.timeout(180)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_all_reaches_every_rank_of_both_nodes(jupyter_prefix, tmp_path):
    port, key = free_port(), tmp_path / "job.key"
    common = ["--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(port)]
    install_spec(jupyter_prefix, "mn", "--nproc", "1", *common, "--key-file", str(key))
    node1 = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes",
            "2",
            "--node_rank",
            "1",
            "--nproc_per_node",
            "1",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(port),
            "-m",
            "shardbook.rankd",
            "--key-file",
            str(key),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    handle = None
    try:
        handle = KernelHandle("mn")
        # ready means every follower is connected: the very first cell sees both ranks idle
        first = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert [line.split()[5] for line in first.splitlines()[1:3]] == ["idle", "idle"], first
        ex = handle.run(
            "%%all\nimport os, torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\n"
            "print('rank', dist.get_rank(), 'of', dist.get_world_size(), "
            "'local', os.environ['LOCAL_RANK'], 'sum', t.item())"
        )
        assert ex.status == "ok", ex.error_text()
        assert "[rank 0]\nrank 0 of 2 local 0 sum 2.0" in ex.stdout()
        assert "[rank 1]\nrank 1 of 2 local 0 sum 2.0" in ex.stdout()
    finally:
        if handle is not None:
            handle.stop()
        assert wait_until(lambda: node1.poll() is not None, timeout=15), (
            "node 1 did not leave after the kernel's shutdown"
        )
        node1.kill()
    assert node1.returncode == 0, node1.stdout.read()


def test_follower_launcher_refuses_rank_0(tmp_path):
    key = tmp_path / "k"
    key.write_text("abc")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "1",
            "-m",
            "shardbook.rankd",
            "--key-file",
            str(key),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode != 0
    assert "rank 0 must be the kernel" in proc.stderr
