"""A rank that fails or never starts at kernel start-up is named where a person looks.

The kernel answers at once, while its ranks start. Once the start failed, the cause is in the
Jupyter server's log (the kernel process's stderr, here a file) and on IOPub: a stream published
as it fails, the ``kernel_info`` banner, the stream that answers ``kernel_info``, and the output of
the next cell.
"""

from __future__ import annotations

import os
import queue
import signal
import time

import pytest
from jupyter_client.manager import KernelManager

from tests.driver import interrupt_when
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

    def __init__(self, log, env: dict[str, str], kernel_name: str = "sb2"):
        self.log = log
        self.km = KernelManager(kernel_name=kernel_name)
        with open(log, "w") as err:
            self.km.start_kernel(env={**os.environ, "PYTHONUNBUFFERED": "1", **env}, stderr=err)
        self.kc = self.km.client()
        self.kc.start_channels()

    def run(self, code: str, timeout: float = 60, **kw):
        from tests.driver import execute

        return execute(self.kc, code, timeout=timeout, **kw)

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


def published(kc, text: str, timeout: float) -> str:
    """The first IOPub stream (under any request) that holds ``text``, waiting up to ``timeout``; "" if none."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except queue.Empty:
            continue
        if msg["msg_type"] == "stream" and text in msg["content"]["text"]:
            return msg["content"]["text"]
    return ""


def assert_reported_at_start(kernel: LoggedKernel, cause: str) -> None:
    """The cause in the server log, in the banner, on IOPub after kernel_info, in the next cell's output, and in
    the refusal of a cell that needs the ranks."""
    assert wait_until(lambda: cause in kernel.server_log(), timeout=150), kernel.server_log()[-3000:]
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
    kernel.kc.wait_for_ready(timeout=120)
    assert_reported_at_start(kernel, "rank 1 of 2 failed at start-up: ImportError: cannot import shardbook.rankd")
    log = kernel.server_log()
    assert "[shardbook rank 1] ERROR" in log and "rank 1 failed at start-up: ImportError" in log, log[-3000:]
    assert "Traceback" in log  # the rank's own traceback, for whoever fixes its environment
    failed = int((tmp_path / "failed.pid").read_text())
    assert wait_until(lambda: gone(failed), timeout=30), "the failed rank is still running"
    assert execute_ok(kernel, "print('kernel alive')") == "kernel alive\n"


def says(text: str):
    """An IOPub message filter: a stream that holds ``text``."""
    return lambda msg: msg["msg_type"] == "stream" and text in msg["content"]["text"]


def execute_ok(kernel: LoggedKernel, code: str) -> str:
    from tests.driver import execute

    ex = execute(kernel.kc, code, timeout=30)
    assert ex.status == "ok", ex.error_text()
    return ex.stdout()


BROKEN_TORCH = """import os, sys
if os.environ.get("RANK") not in (None, "0"):  # a follower whose torch is broken: it fails before any store
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "broken"))
"""


def break_torch_on_followers(folder) -> str:
    """A PYTHONPATH under which every follower's `import torch` raises ImportError (its pid in failed.pid)."""
    (folder / "sitecustomize.py").write_text(BROKEN_TORCH)
    (folder / "broken" / "torch").mkdir(parents=True)
    (folder / "broken" / "torch" / "__init__.py").write_text(
        "import os\n"
        "open(os.path.join(os.path.dirname(__file__), 'failed.pid'), 'w').write(str(os.getpid()))\n"
        "raise ImportError('libtorch_cpu.so: cannot open shared object file (injected by the test)')\n"
    )
    return os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)


BROKEN_TORCH_CAUSE = "rank 1 of 2 failed at start-up: ImportError: libtorch_cpu.so: cannot open"


def test_a_rank_whose_torch_fails_to_import_is_named_though_it_cannot_reach_the_store(logged_kernel, tmp_path):
    """Rank 1's `import torch` raises: it cannot use the job's store, so it leaves a note on the node that rank 0
    reads (before, rank 1 exited 1, the launcher ended the kernel, and nobody said why)."""
    path = break_torch_on_followers(tmp_path)
    kernel = logged_kernel(tmp_path / "server.log", PYTHONPATH=path)  # the default 120 s connect timeout
    kernel.kc.wait_for_ready(timeout=120)
    assert_reported_at_start(kernel, BROKEN_TORCH_CAUSE)
    assert "[shardbook rank 1] ERROR" in kernel.server_log()
    assert "did not start within" not in kernel.server_log()  # the note, not the deadline, ended the wait
    failed = int((tmp_path / "broken" / "torch" / "failed.pid").read_text())
    assert wait_until(lambda: gone(failed), timeout=30), "the failed rank is still running"
    assert execute_ok(kernel, "print('kernel alive')") == "kernel alive\n"


def test_a_rank_that_never_starts_is_named_in_the_server_log_and_on_iopub(logged_kernel, tmp_path):
    """The kernel answers kernel_info at once, its banner saying the ranks are starting, runs cells that do not
    need them, and the stop button ends a magic's wait for them; at the deadline it says which rank never came,
    in the server log and on IOPub."""
    kernel = logged_kernel(tmp_path / "server.log", **late_follower_env(tmp_path, 600, connect_timeout=20))
    stuck = tmp_path / "stuck.pid"
    try:
        kernel.kc.wait_for_ready(timeout=120)
        assert "ranks of this kernel are still starting" in banner(kernel.kc)
        assert execute_ok(kernel, "print('while they start')") == "while they start\n"
        waiting, _ = interrupt_when(kernel, "%dist", says("waiting for the ranks"), wait_s=15, timeout=30)
        assert waiting.status == "error" and "KeyboardInterrupt" in waiting.error_text(), waiting.error_text()
        cause = "rank 1 of 2 did not start within SHARDBOOK_CONNECT_TIMEOUT"
        published_at_deadline = published(kernel.kc, cause, timeout=150)  # with no request of ours: as it fails
        assert "restart the kernel" in published_at_deadline, published_at_deadline
        assert_reported_at_start(kernel, cause)
        assert "still starting" not in banner(kernel.kc)
    finally:
        if wait_until(stuck.exists, timeout=5):
            os.kill(int(stuck.read_text()), signal.SIGKILL)
