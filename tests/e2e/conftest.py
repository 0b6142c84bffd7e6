"""Kernels started from an installed shardbook kernelspec through jupyter_client, like a frontend."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from jupyter_client.manager import KernelManager

from shardbook.rankd.control.lifetime import pid_alive
from tests.driver import execute

ROOT = Path(__file__).resolve().parents[2]


def install_spec(prefix: Path, name: str, *extra: str) -> None:
    subprocess.run(
        [sys.executable, "-m", "shardbook.kernel.cli.main", "install", "--prefix", str(prefix), "--name", name, *extra],
        check=True,
        capture_output=True,
    )


@pytest.fixture(scope="session")
def jupyter_prefix(tmp_path_factory) -> Path:
    """A private Jupyter data dir holding the test kernelspecs (JUPYTER_PATH points at it)."""
    prefix = tmp_path_factory.mktemp("jupyter")
    install_spec(prefix, "sb2", "--nproc", "2")
    os.environ["JUPYTER_PATH"] = str(prefix / "share" / "jupyter")
    return prefix


class KernelHandle:
    """A started kernel and its client; ``run`` executes a cell and returns an Execution."""

    def __init__(self, name: str, env: dict[str, str] | None = None):
        self.km = KernelManager(kernel_name=name)
        self.env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
        self.start()

    def start(self) -> None:
        self.km.start_kernel(env=self.env)
        self.kc = self.km.client()
        self.kc.start_channels()
        try:
            self.kc.wait_for_ready(timeout=90)
        except BaseException:  # a kernel that never became ready leaves nothing behind (processes, a Slurm job)
            self.kc.stop_channels()
            self.km.shutdown_kernel(now=True)
            raise

    def run(self, code: str, timeout: float = 60, **kw):
        return execute(self.kc, code, timeout=timeout, **kw)

    def rank_pids(self) -> dict[int, int]:
        ex = self.run("%%all\nimport os, torch.distributed as dist\nprint('PID', dist.get_rank(), os.getpid())")
        assert ex.status == "ok", ex.error_text()
        pairs = [line.split()[1:] for line in ex.stdout().splitlines() if line.startswith("PID ")]
        return {int(r): int(p) for r, p in pairs}

    def stop(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=False)


@pytest.fixture(scope="session")
def kernel(jupyter_prefix):
    """One shared 2-rank kernel for the tests that leave it healthy."""
    handle = KernelHandle("sb2")
    yield handle
    handle.stop()


@pytest.fixture
def fresh_kernel(jupyter_prefix):
    """A private 2-rank kernel for tests that kill, stop or wedge ranks; extra env per test."""
    handles = []

    def start(**env: str) -> KernelHandle:
        handles.append(KernelHandle("sb2", env))
        return handles[-1]

    yield start
    for handle in handles:
        try:
            handle.stop()
        except Exception:  # a kernel the test killed on purpose
            handle.km.cleanup_resources() if handle.km.has_kernel else None


def gone(pid: int) -> bool:
    """The process ended (a zombie not yet reaped counts as ended)."""
    return not pid_alive(pid)


def wait_until(predicate, timeout: float, interval: float = 0.1):
    """Poll ``predicate`` until truthy or the deadline passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
