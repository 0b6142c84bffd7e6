"""The one-node launcher (``shardbook.kernel.cli.localrun``): torchrun's job without importing torch."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

RANK_MODULE = """
import json, os, sys, time
out = os.environ["OUT"]
what = os.environ.get("WHAT", "group")
rank = int(os.environ["RANK"])
if what == "group":  # join a real process group through torchrun's environment, and sum the ranks
    import torch, torch.distributed as dist
    dist.init_process_group("gloo")
    t = torch.tensor([rank + 1])
    dist.all_reduce(t)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "TORCHELASTIC_RUN_ID"]
    facts = {k: os.environ[k] for k in keys}
    facts.update(sum=int(t), own_session=os.getsid(0) == os.getpid())
    with open(f"{out}/{rank}.json", "w") as f:
        json.dump(facts, f)
    dist.destroy_process_group()
elif what == "fail" and rank == 1:
    sys.exit(3)
elif what == "kill" and rank == 1:
    os.kill(os.getpid(), 9)
else:  # wait to be ended, and say so
    open(f"{out}/{rank}.waiting", "w").close()
    time.sleep(120)
"""

LAUNCHER = """
import sys
from shardbook.kernel.cli import localrun
code = localrun.main(["--nproc", "2", "-m", "rank_module"])
print("TORCH_IN_LAUNCHER", "torch" in sys.modules, flush=True)
sys.exit(code)
"""


def start(tmp_path: Path, what: str) -> subprocess.Popen:
    (tmp_path / "rank_module.py").write_text(RANK_MODULE)
    env = {"PYTHONPATH": str(tmp_path), "OUT": str(tmp_path), "WHAT": what, "PATH": "/usr/bin:/bin"}
    pipes = dict(stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.Popen([sys.executable, "-c", LAUNCHER], env=env, cwd=tmp_path, **pipes)


def wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert time.monotonic() < deadline, f"{path.name} never appeared"
        time.sleep(0.05)


def test_ranks_join_a_process_group_and_the_launcher_never_imports_torch(tmp_path):
    launcher = start(tmp_path, "group")
    out, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 0, err
    assert "TORCH_IN_LAUNCHER False" in out
    facts = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert [f["sum"] for f in facts] == [3, 3]
    assert [(f["RANK"], f["LOCAL_RANK"], f["WORLD_SIZE"], f["LOCAL_WORLD_SIZE"]) for f in facts] == [
        ("0", "0", "2", "2"),
        ("1", "1", "2", "2"),
    ]
    assert {f["GROUP_RANK"] for f in facts} == {"0"} and facts[0]["MASTER_ADDR"] == "127.0.0.1"
    assert facts[0]["TORCHELASTIC_RUN_ID"] == facts[1]["TORCHELASTIC_RUN_ID"]
    assert all(f["own_session"] for f in facts), "every rank runs in a session of its own, as under torchrun"


@pytest.mark.parametrize("what, status, line", [("fail", 3, None), ("kill", 137, "rank 1 was ended by SIGKILL")])
def test_a_failed_rank_ends_the_others_and_gives_its_status(tmp_path, what, status, line):
    launcher = start(tmp_path, what)
    out, err = launcher.communicate(timeout=60)  # rank 0 would wait 120 s unless the launcher ends it
    assert launcher.returncode == status, err
    if line:
        assert line in err
    else:
        assert "was ended by" not in err  # a rank that exits with a status has said why itself


def test_sigterm_goes_to_every_rank(tmp_path):
    launcher = start(tmp_path, "wait")
    for r in range(2):
        wait_for(tmp_path / f"{r}.waiting")
    launcher.send_signal(signal.SIGTERM)
    out, err = launcher.communicate(timeout=30)
    assert launcher.returncode == 128 + signal.SIGTERM, err
    assert "was ended by" not in err


def test_a_follower_started_long_before_rank_0s_store_still_joins(monkeypatch):
    """Under the launcher rank 0 hosts the store, and sets up the kernel first: a follower waits for it, whatever
    the collective timeout (here 1 s; the store's client used to give up after it)."""
    import threading

    from shardbook.kernel.cli.localrun import free_port
    from shardbook.rankd.control.world import JobShape, job_store

    port = free_port()
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    monkeypatch.setenv("SHARDBOOK_PG_TIMEOUT", "1")
    monkeypatch.delenv("TORCHELASTIC_USE_AGENT_STORE", raising=False)
    hosted = []
    late = threading.Timer(2.0, lambda: hosted.append(job_store(JobShape(0, 2, 0, 2, under_torchrun=True))))
    late.start()
    follower = job_store(JobShape(1, 2, 1, 2, under_torchrun=True))
    late.join()
    follower.set("hello", "from rank 1")
    assert hosted[0].get("hello") == b"from rank 1"


def test_the_store_port_is_free_and_under_the_ephemeral_range():
    """Outgoing connections and port-0 binds (Jupyter's own ports) take ports from the ephemeral range, so a port
    picked there can be gone by the time rank 0 binds it (EADDRINUSE at start-up, seen with five kernels)."""
    import socket

    from shardbook.kernel.cli.localrun import PORTS_BELOW_EPHEMERAL, ephemeral_range_start, free_port

    low = ephemeral_range_start()
    for _ in range(20):
        port = free_port()
        assert low - PORTS_BELOW_EPHEMERAL <= port < low
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))
