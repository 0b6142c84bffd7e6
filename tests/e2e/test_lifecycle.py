"""Ranks that die, hang, idle or wedge; shutdown and restart leave no process behind."""

from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from tests.driver import interrupt_when
from tests.e2e.conftest import KernelHandle, gone, wait_until

pytestmark = pytest.mark.timeout(180)


def run_in_background(handle, code: str, timeout: float = 60):
    """Start a cell in a thread; returns (thread, result, started).

    ``result["messages"]`` collects the cell's IOPub messages as they arrive, so they survive a
    kernel that dies mid-cell; ``result["ex"]`` is the Execution when a reply came.
    """
    result, started = {"messages": []}, threading.Event()

    def on_message(msg):
        result["messages"].append(msg)
        if msg["msg_type"] == "stream":
            started.set()

    def target():
        try:
            result["ex"] = handle.run(code, timeout=timeout, on_message=on_message)
        except Exception as e:  # the kernel died under the cell
            result["exc"] = e

    thread = threading.Thread(target=target)
    thread.start()
    return thread, result, started


@pytest.fixture(scope="module")
def tuned_kernel(jupyter_prefix, tmp_path_factory):
    """One kernel for the tests below that leave it healthy (one start instead of three): a 3 s collective
    timeout, a 1 MiB message limit and start-up marks (``handle.marks``)."""
    marks = tmp_path_factory.mktemp("lifecycle") / "marks"
    env = {"SHARDBOOK_PG_TIMEOUT": "3", "SHARDBOOK_MAX_MESSAGE_MB": "1", "SHARDBOOK_STARTUP_MARKS": str(marks)}
    handle = KernelHandle("sb2", env)
    handle.marks = marks
    yield handle
    handle.stop()


def test_restart_soft_then_hard_then_shutdown_leave_no_orphans(fresh_kernel, tmp_path):
    """One kernel through all three: a restart gives a working pool of new ranks; restart(now=True) SIGKILLs
    torchrun and the workers (own sessions) must still go away; shutdown ends every rank and the launcher.

    The hard restart meets the old rank 0 still holding the kernel's ports (a restart reuses them), as a rank
    0 slow to end on a busy machine does: here it is stopped until the new rank 0 has seen the ports taken.
    The new one waits for them instead of dying of EADDRINUSE.
    """
    marks = tmp_path / "marks"
    handle = fresh_kernel(SHARDBOOK_STARTUP_MARKS=str(marks))
    old = handle.rank_pids()
    handle.km.restart_kernel(now=False)
    assert wait_until(lambda: all(gone(p) for p in old.values()), timeout=30), "orphaned ranks after a restart"
    handle.kc.wait_for_ready(timeout=90)
    new = handle.rank_pids()
    assert set(new) == {0, 1} and not set(new.values()) & set(old.values())

    os.kill(new[0], signal.SIGSTOP)  # it keeps the ports until SIGCONT lets it take the launcher's SIGTERM
    try:
        handle.km.restart_kernel(now=True)
        assert wait_until(lambda: "kernel_ports_busy" in marks.read_text(), timeout=60), (
            "the new rank 0 did not wait for the ports the old one holds (ipykernel then dies of EADDRINUSE)"
        )
    finally:
        os.kill(new[0], signal.SIGCONT)
    assert wait_until(lambda: all(gone(p) for p in new.values()), timeout=30), "orphaned ranks after a hard restart"
    handle.kc.wait_for_ready(timeout=90)
    assert handle.run("%%all\nprint('back')").stdout().count("back") == 2

    pids = handle.rank_pids()
    launcher = handle.km.provisioner.process.pid
    handle.stop()
    assert wait_until(lambda: all(gone(p) for p in [*pids.values(), launcher]), timeout=30), "a rank outlived shutdown"


def test_killed_follower_is_reported_then_restart_works(fresh_kernel):
    handle = fresh_kernel()
    pids = handle.rank_pids()
    thread, result, started = run_in_background(
        handle, "%%all\nimport time\nprint('working', flush=True)\ntime.sleep(60)", timeout=15
    )
    assert started.wait(20)
    killed_at = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    thread.join(20)
    # Either the pool notices first (the cell fails naming the dead rank) or torchrun's teardown
    # reaches rank 0 first (a notice in the cell, then the kernel exits); both must name rank 1.
    reports = [
        (m["received_at"], m["content"].get("text", "") + m["content"].get("evalue", ""))
        for m in result["messages"]
        if m["msg_type"] in ("stream", "error")
    ]
    named = [(at, text) for at, text in reports if f"pid {pids[1]}" in text and "restart the kernel" in text]
    assert named, reports
    assert "rank 1" in named[0][1] and "exited" in named[0][1]
    assert named[0][0] - killed_at < 10
    handle.km.restart_kernel(now=True)
    handle.kc.wait_for_ready(timeout=90)
    assert handle.run("%%all\nprint('alive')").stdout().count("alive") == 2


def dist_row(handle, rank: int) -> str:
    return handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"].splitlines()[1 + rank]


def test_silent_follower_is_dead_after_the_heartbeat_timeout(fresh_kernel):
    """A follower stopped longer than SHARDBOOK_HEARTBEAT_TIMEOUT is dead, and the reason says it was silence."""
    handle = fresh_kernel(SHARDBOOK_HEARTBEAT_TIMEOUT="5")
    pids = handle.rank_pids()
    thread, result, started = run_in_background(
        handle, "%%all\nimport time\nprint('working', flush=True)\ntime.sleep(60)"
    )
    assert started.wait(20)
    os.kill(pids[1], signal.SIGSTOP)
    try:
        stopped_at = time.monotonic()
        thread.join(15)
        assert time.monotonic() - stopped_at < 10
        ex = result["ex"]
        assert ex.status == "error" and "rank 1 died: it has not answered heartbeats for 5 s" in ex.error_text()
        assert f"its process (pid {pids[1]}) still exists" in ex.error_text()
        assert "rank 1 has not answered heartbeats for 3 s" in ex.stderr()  # said while the cell waited
        assert "dead" in dist_row(handle, 1)
        refused = handle.run("%%all\nprint(1)")
        assert refused.status == "error" and "Restart the kernel" in refused.stderr()
    finally:
        os.kill(pids[1], signal.SIGCONT)
    handle.km.restart_kernel(now=True)
    handle.kc.wait_for_ready(timeout=90)
    assert handle.run("%%all\nprint('ok again')").stdout().count("ok again") == 2


HOLD_THE_GIL = "import ctypes\nctypes.PyDLL(None).sleep({seconds})  # libc's sleep, called without releasing the GIL\n"


def test_ranks_holding_the_gil_are_not_declared_dead(fresh_kernel):
    """Heartbeats are answered without the GIL: 8 s of GIL-bound code on either side, timeouts of 3 s."""
    handle = fresh_kernel(SHARDBOOK_HEARTBEAT_TIMEOUT="3", SHARDBOOK_RANK0_TIMEOUT="3")
    pids = handle.rank_pids()
    follower = handle.run("%%rank 1\n" + HOLD_THE_GIL.format(seconds=8) + "print('held')", timeout=60)
    assert follower.status == "ok" and follower.stdout() == "[rank 1]\nheld\n", follower.error_text()
    rank0 = handle.run(HOLD_THE_GIL.format(seconds=8) + "print('held')", timeout=60)
    assert rank0.status == "ok" and rank0.stdout() == "held\n"
    assert handle.rank_pids() == pids


def test_a_stopped_follower_comes_back(fresh_kernel):
    """SIGSTOP for 20 s, then SIGCONT: shown silent meanwhile, then the next cell works (default timeouts)."""
    handle = fresh_kernel()
    pids = handle.rank_pids()
    os.kill(pids[1], signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        assert wait_until(lambda: "silent" in dist_row(handle, 1), timeout=15, interval=0.5)
        time.sleep(max(0.0, 20 - (time.monotonic() - stopped_at)))  # the length of the stop is the subject
    finally:
        os.kill(pids[1], signal.SIGCONT)
    ex = handle.run("%%all\nprint('back')", timeout=60)
    assert ex.status == "ok" and ex.stdout().count("back") == 2, ex.error_text()
    assert wait_until(lambda: dist_row(handle, 1).split()[5:6] == ["idle"], timeout=10, interval=0.5), dist_row(
        handle, 1
    )


def test_idle_longer_than_the_collective_timeout(tuned_kernel):
    handle = tuned_kernel
    assert handle.run("%%all\nimport torch, torch.distributed as dist").status == "ok"
    time.sleep(5)  # the idle gap itself is the subject of this test
    ex = handle.run("%%all\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('sum', t.item())")
    assert ex.status == "ok", ex.error_text()
    assert ex.stdout().count("sum 2.0") == 2


def test_rank0_failing_before_a_collective_does_not_wedge_silently(fresh_kernel):
    handle = fresh_kernel(SHARDBOOK_PG_TIMEOUT="10")
    code = (
        "%%all\nimport torch, torch.distributed as dist\n"
        "if dist.get_rank() == 0:\n    raise RuntimeError('rank 0 fails first')\n"
        "dist.all_reduce(torch.ones(1))"
    )

    def noticed(msg):
        return msg["msg_type"] == "stream" and "still running" in msg["content"]["text"]

    ex, seconds = interrupt_when(handle, code, noticed, wait_s=10, timeout=60)
    assert seconds < 5
    assert ex.status == "error"
    assert "did not stop" in ex.stderr() and "process-group timeout" in ex.stderr()
    table = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "busy" in table.splitlines()[2]
    refused = handle.run("%%rank 1\nprint(1)")
    assert refused.status == "error" and "still busy" in refused.stderr()

    def rank1_idle():
        return (
            "idle" in handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"].splitlines()[2]
        )

    assert wait_until(rank1_idle, timeout=20, interval=0.5), "the process-group timeout did not free rank 1"
    assert handle.run("%%rank 1\nprint('free')").stdout() == "[rank 1]\nfree\n"


ABUSE = """
import zmq
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.rankd.control import protocol
endpoint = get_runtime().world.store.get(protocol.CONTROL_KEY).decode()
attacker = zmq.Context.instance().socket(zmq.DEALER)
attacker.connect(endpoint)
attacker.send_multipart([b"<IDS|MSG>", b"A" * 2_000_000, b"{}", b"{}", b"{}", b"{}"])  # over the 1 MiB limit
for i in range(3000):  # the delimiter alone, and unsigned messages with a payload
    attacker.send_multipart([b"<IDS|MSG>"] if i % 2 else [b"<IDS|MSG>", b"PAYLOAD" * 100, b"{}", b"{}", b"{}", b"{}"])
attacker.close(linger=5000)
print("sent")
"""


def test_control_plane_abuse_neither_breaks_the_pool_nor_reaches_cells(tuned_kernel):
    """Malformed messages on rank 0's control socket: dropped, logged to the server log only."""
    handle = tuned_kernel
    sent = handle.run(ABUSE)
    assert sent.stdout() == "sent\n", sent.error_text()
    after = handle.run("%%all\nprint('alive')", timeout=30)
    assert after.status == "ok" and after.stdout().count("alive") == 2, after.error_text()
    for ex in (sent, after):
        assert "PAYLOAD" not in ex.text() and "dropped" not in ex.text(), ex.text()[:500]
    too_big = handle.run("%%rank 1\nprint('x' * 2_000_000)")  # a follower's own output over the limit
    assert too_big.status == "error" and "SHARDBOOK_MAX_MESSAGE_MB" in too_big.error_text(), too_big.error_text()[:500]
    assert handle.run("%%all\nprint('still alive')").stdout().count("still alive") == 2


STARTS_AFTER = """import os, time
if os.environ.get("RANK") not in (None, "0"):  # a follower that reaches shardbook once told to (or after {seconds} s)
    here = os.path.dirname(__file__)
    with open(os.path.join(here, "stuck.pid"), "w") as f:
        f.write(str(os.getpid()))
    deadline = time.monotonic() + {seconds}
    while not os.path.exists(os.path.join(here, "go")) and time.monotonic() < deadline:
        time.sleep(0.1)
"""


def late_follower_env(tmp_path, seconds: int, connect_timeout: int = 5) -> dict[str, str]:
    """Environment for a kernel whose rank 1 starts late: when the test writes ``go`` beside its sitecustomize,
    or ``seconds`` after it started."""
    (tmp_path / "sitecustomize.py").write_text(STARTS_AFTER.format(seconds=seconds))
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH", "")) if p)
    return {"SHARDBOOK_CONNECT_TIMEOUT": str(connect_timeout), "PYTHONPATH": path}


def iopub_text(kc, parent_id: str, timeout: float) -> str:
    """The stream text IOPub carries for the request ``parent_id``, until ``timeout`` passes."""
    deadline, text = time.monotonic() + timeout, ""
    while time.monotonic() < deadline and not text:
        try:
            msg = kc.get_iopub_msg(timeout=0.2)
        except Exception:  # queue.Empty
            continue
        if msg["parent_header"].get("msg_id") == parent_id and msg["msg_type"] == "stream":
            text += msg["content"]["text"]
    return text


def test_a_follower_only_connects_after_the_rendezvous(tuned_kernel):
    """Its control session is made before it joins the process group (while rank 0 still imports torch under
    ipykernel) and its shell after its hello, so between the rendezvous and the hello, where rank 0 waits for
    it, it imports nothing."""
    handle = tuned_kernel
    assert set(handle.rank_pids()) == {0, 1}, "a cell uses torch.distributed on every rank"
    modules = {
        (rank, name): int(count)
        for rank, name, _at, count, _cpu in map(str.split, handle.marks.read_text().splitlines())
    }
    assert modules[("1", "hello")] == modules[("1", "process_group_up")], modules


def test_a_rank_that_never_starts_is_reported_at_once_by_every_magic(fresh_kernel, tmp_path):
    handle = fresh_kernel(**late_follower_env(tmp_path, 600, connect_timeout=15))
    try:
        first = handle.run("%dist", timeout=150)  # the first magic waits for the start, then names its cause
        assert first.status == "error" and "rank 1 of 2 did not start" in first.stderr(), first.stderr()
        announced = iopub_text(handle.kc, handle.kc.kernel_info(), timeout=10)
        assert "rank 1 of 2 did not start" in announced and "restart the kernel" in announced, announced
        threads = handle.run("import threading; print(threading.active_count())").stdout()
        for code in (
            "%%all\nprint(1)",
            "%dist",
            "%%rank 1\nprint(1)",
            "%shards",
            "%load_sharded",
            "%%chat\nHi",
            "%%all\nprint(2)",
        ):
            ex = handle.run(code, timeout=10)  # less than the connect timeout: nothing waits for it again
            assert ex.status == "error", code
            assert "rank 1 of 2 did not start" in ex.stderr() and "restart the kernel" in ex.stderr(), ex.stderr()
        assert handle.run("import threading; print(threading.active_count())").stdout() == threads
    finally:
        stuck = tmp_path / "stuck.pid"
        if stuck.exists():
            os.kill(int(stuck.read_text()), signal.SIGKILL)


LAUNCHER = """
import time
from jupyter_client.manager import KernelManager
km = KernelManager(kernel_name="sb2")
km.start_kernel()
client = km.client()
client.start_channels()
client.wait_for_ready(timeout=90)
print(km.provisioner.process.pid, flush=True)
time.sleep(600)
"""


def test_a_rank_that_starts_after_the_kernel_gave_up_leaves(fresh_kernel, tmp_path):
    """It must neither hang in the process group's rendezvous nor take the kernel down with it."""
    handle = fresh_kernel(**late_follower_env(tmp_path, 120))
    stuck = tmp_path / "stuck.pid"
    try:
        assert "rank 1 of 2 did not start" in handle.run("%%all\nprint(1)").stderr()
        assert wait_until(stuck.exists, timeout=30)
        (tmp_path / "go").touch()  # the kernel gave up: now rank 1 goes on into shardbook
        assert wait_until(lambda: gone(int(stuck.read_text())), timeout=60), "the late rank is still running"
        ex = handle.run("%%all\nprint(1)", timeout=4)
        assert (
            "rank 1 of 2 did not start" in ex.stderr()
            and handle.run("print('kernel alive')").stdout() == "kernel alive\n"
        )
    finally:
        if stuck.exists() and not gone(int(stuck.read_text())):
            os.kill(int(stuck.read_text()), signal.SIGKILL)


def test_every_rank_leaves_when_the_launcher_is_killed(jupyter_prefix):
    """A Jupyter server SIGKILLed (here: a small launcher process) must not leave torchrun and the ranks behind."""
    import subprocess
    import sys

    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", LAUNCHER], stdout=subprocess.PIPE, text=True)
    leftovers: list[int] = []
    try:
        ready = wait_until(lambda: launcher.stdout.readline().strip(), timeout=120)  # blocks until the pid line
        torchrun = int(ready)
        leftovers = [torchrun, *(p.pid for p in psutil.Process(torchrun).children())]
        assert len(leftovers) == 3, leftovers  # torchrun and its two ranks
        launcher.kill()
        launcher.wait(10)
        assert wait_until(lambda: all(gone(p) for p in leftovers), timeout=15), [p for p in leftovers if not gone(p)]
    finally:
        launcher.kill()
        for pid in leftovers:
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)
