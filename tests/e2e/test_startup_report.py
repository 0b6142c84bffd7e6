"""A rank that fails or never starts at kernel start-up is named where a person looks.

In the Jupyter server's log (the kernel process's stderr, here a file) and, once the kernel is up,
on IOPub: the ``kernel_info`` banner, the stream that answers ``kernel_info``, and the output of
the first cell.
"""

from __future__ import annotations

import os
import signal

import pytest
from jupyter_client.manager import KernelManager

from tests.e2e.conftest import gone, wait_until
from tests.e2e.test_lifecycle import iopub_text, late_follower_env

pytestmark = pytest.mark.timeout(240)

FAILS_AT_IMPORT = """import os, sys
if os.environ.get("RANK") not in (None, "0"):  # a follower whose environment lacks a module it imports
    class NoCommands:
        def find_spec(self, name, path=None, target=None):
            if name == "shardbook.rankd.commands":
                with open(os.path.join(os.path.dirname(__file__), "failed.pid"), "w") as f:
                    f.write(str(os.getpid()))
                raise ImportError("cannot import shardbook.rankd.commands (injected by the test)")
            return None
    sys.meta_path.insert(0, NoCommands())
"""


class LoggedKernel:
    """A 2-rank kernel whose stderr (what the Jupyter server logs) goes to ``log``."""

    def __init__(self, log, env: dict[str, str]):
        self.log = log
        self.km = KernelManager(kernel_name="sb2")
        with open(log, "w") as err:
            self.km.start_kernel(env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stderr=err)
        self.kc = self.km.client()
        self.kc.start_channels()

    def server_log(self) -> str:
        return self.log.read_text(errors="replace")

    def stop(self) -> None:
        self.kc.stop_channels()
        if self.km.has_kernel:
            self.km.shutdown_kernel(now=True)


@pytest.fixture
def logged_kernel(jupyter_prefix):
    kernels = []

    def start(log, **env: str) -> LoggedKernel:
        kernels.append(LoggedKernel(log, env))
        return kernels[-1]

    yield start
    for kernel in kernels:
        kernel.stop()


def banner(kc) -> str:
    msg_id = kc.kernel_info()
    while True:
        reply = kc.get_shell_msg(timeout=30)
        if reply["parent_header"].get("msg_id") == msg_id:
            return reply["content"]["banner"]


def assert_reported_at_start(kernel: LoggedKernel, cause: str) -> None:
    """The cause in the server log, in the banner, on IOPub after kernel_info and in the first cell's output."""
    kernel.kc.wait_for_ready(timeout=120)  # the kernel is up: only its pool failed
    assert wait_until(lambda: cause in kernel.server_log(), timeout=10), kernel.server_log()[-3000:]
    assert "[shardbook rank 0] ERROR the rank pool of this kernel failed to start" in kernel.server_log()
    assert cause in banner(kernel.kc)
    announced = iopub_text(kernel.kc, kernel.kc.kernel_info(), timeout=30)
    assert cause in announced and "restart the kernel" in announced, announced
    from tests.driver import execute

    first = execute(kernel.kc, "print('hello')", timeout=30)
    assert first.status == "ok" and first.stdout() == "hello\n" and cause in first.stderr(), first.stderr()
    refused = execute(kernel.kc, "%%all\nprint(1)", timeout=30)
    assert refused.status == "error" and cause in refused.stderr(), refused.stderr()


def test_a_rank_failing_at_import_is_named_in_the_server_log_and_on_iopub(logged_kernel, tmp_path):
    """Rank 1 raises ImportError at start-up: it says so in its log line, tells rank 0 and leaves with status 0,
    so the launcher does not end the kernel before it reports it (before, the kernel died before kernel_info
    and the server's log named neither rank 1 nor its error)."""
    (tmp_path / "sitecustomize.py").write_text(FAILS_AT_IMPORT)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    kernel = logged_kernel(tmp_path / "server.log", PYTHONPATH=path)
    assert_reported_at_start(kernel, "rank 1 of 2 failed at start-up: ImportError: cannot import shardbook.rankd")
    log = kernel.server_log()
    assert "[shardbook rank 1] ERROR" in log and "rank 1 failed at start-up: ImportError" in log, log[-3000:]
    assert "Traceback" in log  # the rank's own traceback, for whoever fixes its environment
    failed = int((tmp_path / "failed.pid").read_text())
    assert wait_until(lambda: gone(failed), timeout=30), "the failed rank is still running"
    assert execute_ok(kernel, "print('kernel alive')") == "kernel alive\n"


def execute_ok(kernel: LoggedKernel, code: str) -> str:
    from tests.driver import execute

    ex = execute(kernel.kc, code, timeout=30)
    assert ex.status == "ok", ex.error_text()
    return ex.stdout()


def test_a_rank_that_never_starts_is_named_in_the_server_log_and_on_iopub(logged_kernel, tmp_path):
    kernel = logged_kernel(tmp_path / "server.log", **late_follower_env(tmp_path, 600, connect_timeout=10))
    stuck = tmp_path / "stuck.pid"
    try:
        assert_reported_at_start(kernel, "rank 1 of 2 did not start within SHARDBOOK_CONNECT_TIMEOUT")
    finally:
        if wait_until(stuck.exists, timeout=5):
            os.kill(int(stuck.read_text()), signal.SIGKILL)
