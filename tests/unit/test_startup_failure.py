"""A pool that fails to start names the missing rank(s) and says so in the kernel's log, not only in the magics."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from shardbook.kernel.ranks import runtime
from shardbook.kernel.ranks.pool import PoolError
from shardbook.rankd.control import startup_notes, world


def test_a_rank_that_never_arrived_is_named(monkeypatch):
    monkeypatch.setattr(world, "CONNECT_TIMEOUT_S", 0.1)
    store = dist.HashStore()
    store.set("shardbook/arrived/2", "1")  # rank 2 came, rank 1 never did
    store.add("shardbook/arrived", 1)
    with pytest.raises(RuntimeError, match=r"rank 1 of 3 did not start within SHARDBOOK_CONNECT_TIMEOUT") as failed:
        world.wait_for_every_rank(store, 3, rank=0)
    assert "only" not in str(failed.value)
    assert "rank 1 of 3" in store.get(world.STARTUP_FAILED_KEY).decode()


def test_the_start_up_failure_is_written_to_the_process_stderr(monkeypatch, capfd):
    """The process's own stderr is the Jupyter server's log (sys.stderr is the running cell's output)."""

    def fail(shell):
        raise RuntimeError("rank 1 of 2 did not start within SHARDBOOK_CONNECT_TIMEOUT")

    monkeypatch.setattr(runtime, "_runtime", None)
    monkeypatch.setattr(runtime, "_failure", None)
    monkeypatch.setattr(runtime, "start_runtime", fail)
    with pytest.raises(PoolError, match="rank 1 of 2"):
        runtime.get_runtime(shell=object())
    written = capfd.readouterr().err
    assert "[shardbook rank 0] ERROR the rank pool of this kernel failed to start: rank 1 of 2 did not" in written


def test_a_rank_that_failed_before_arriving_ends_the_wait_at_once_naming_its_error():
    store = dist.HashStore()
    for rank in (1, 2):  # the same failure on two ranks shows once, with both
        store.set(f"{world.STARTUP_ERROR_KEY}/{rank}", "ImportError: no module named 'x'")
        store.add(world.STARTUP_ERROR_KEY, 1)
    store.set(f"{world.STARTUP_ERROR_KEY}/3", "ValueError: no control-plane key")
    store.add(world.STARTUP_ERROR_KEY, 1)
    with pytest.raises(RuntimeError) as failed:  # long before SHARDBOOK_CONNECT_TIMEOUT (120 s)
        world.wait_for_every_rank(store, 5, rank=0)
    text = str(failed.value)
    assert "ranks 1, 2 of 5 failed at start-up: ImportError: no module named 'x'" in text
    assert "rank 3 of 5 failed at start-up: ValueError: no control-plane key" in text
    assert store.get(world.STARTUP_FAILED_KEY).decode() == text


def test_a_follower_that_waited_leaves_quietly_since_rank_0_reports_it(monkeypatch):
    monkeypatch.setattr(world, "CONNECT_TIMEOUT_S", 0.1)
    store = dist.HashStore()
    with pytest.raises(world.StartupAbandoned, match="ranks 0, 2 of 3 did not start"):
        world.wait_for_every_rank(store, 3, rank=1)  # a failed exit would make the launcher end the kernel


@pytest.fixture
def job_notes(monkeypatch, tmp_path):
    """A job of its own (its notes' directory is named from MASTER_PORT), on rank 0's node."""
    monkeypatch.setenv("MASTER_PORT", f"test-{tmp_path.name}")
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.delenv(startup_notes.NOTES_ENV, raising=False)
    yield startup_notes.notes_dir()
    startup_notes.clear_notes()


def test_a_note_left_without_torch_or_the_store_ends_the_wait_naming_its_error(job_notes):
    assert startup_notes.leave_note(1, "ImportError: libtorch_cpu.so: cannot open shared object file")
    assert job_notes.stat().st_mode & 0o777 == 0o700 and job_notes.parent.parent.stat().st_mode & 0o777 == 0o700
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed at start-up: ImportError: libtorch_cpu.so") as failed:
        world.wait_for_every_rank(dist.HashStore(), 2, rank=0)  # long before SHARDBOOK_CONNECT_TIMEOUT (120 s)
    assert "(the Jupyter server's log has the traceback)" in str(failed.value)


def test_a_rank_on_another_node_reports_through_the_store_only(job_notes, monkeypatch):
    monkeypatch.setenv("GROUP_RANK", "1")
    assert not startup_notes.leave_note(3, "ImportError: x")
    assert not job_notes.exists()


def test_a_rank_on_another_node_leaves_its_note_in_the_folder_every_node_shares(job_notes, monkeypatch, tmp_path):
    """The launcher named a shared folder (Slurm, beside its lease): the note is named without this node's
    launcher's process id, so rank 0 under another launcher reads it."""
    monkeypatch.setenv(startup_notes.NOTES_ENV, str(tmp_path / "shared"))
    monkeypatch.setenv("GROUP_RANK", "1")
    assert startup_notes.leave_note(1, "ImportError: libtorch_cpu.so: cannot open shared object file")
    assert (tmp_path / "shared").stat().st_mode & 0o777 == 0o700
    monkeypatch.setenv("GROUP_RANK", "0")
    monkeypatch.setattr(startup_notes.os, "getppid", lambda: 1)  # rank 0's launcher is another process
    with pytest.raises(RuntimeError, match=r"rank 1 of 2 failed at start-up: ImportError: libtorch_cpu.so"):
        world.wait_for_every_rank(dist.HashStore(), 2, rank=0)
    startup_notes.clear_notes()
    assert not startup_notes.notes_dir().exists() and not job_notes.exists()
