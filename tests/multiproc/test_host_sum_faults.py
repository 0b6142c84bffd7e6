"""Shared-memory sums (`rankd.parallel.host_sum`) under races, interrupts, mismatched ranks and a full tmpfs.

No barrier between sums: a rank that finishes reading one sum writes the next into the other buffer
while a peer still reads, which is the two-buffer protocol at work. An interrupt is injected at every
stage of a sum (through `HostSum.stage_hook`), raised directly or as a real SIGINT, and reaches every
rank as the stop button's does; the next "cell" (after a gloo barrier) must sum correctly.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch

from shardbook.rankd.parallel import host_sum
from shardbook.rankd.parallel.host_sum import HostSum, SumAbandoned, SumMismatch

SIZES = [1, 576, 4096, 1 << 18]
DTYPES = [torch.float32, torch.bfloat16, torch.int64]
INTERRUPT_DEADLINE_S = 20.0


def inputs(call: int, world: int) -> list[torch.Tensor]:
    """Every rank's input to sum number `call` (each rank can make all of them: the expected sum is known)."""
    dtype, numel = DTYPES[call % len(DTYPES)], SIZES[call % len(SIZES)]
    made = []
    for rank in range(world):
        generator = torch.Generator().manual_seed(call * world + rank)
        made.append((torch.randn(numel, generator=generator) * 100).to(dtype))
    return made


def expected(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0] + parts[1]  # in rank order, as host_sum adds: the same bits
    for part in parts[2:]:
        total += part
    return total


def shared_sum(group) -> HostSum:
    found = host_sum.host_sum_for(group)
    assert found is not None, "ranks on one host should sum through shared memory"
    return found


def sums_in_a_row(rank: int, world: int, first: int, count: int, group) -> list[int]:
    """`count` sums with no barrier between them; the calls whose result was wrong."""
    sums, wrong = shared_sum(group), []
    for call in range(first, first + count):
        parts = inputs(call, world)
        got = sums.sum_(parts[rank].clone())
        if not torch.equal(got, expected(parts)):
            wrong.append(call)
    return wrong


def race(rank: int, world: int) -> list[int]:
    import torch.distributed as dist

    return sums_in_a_row(rank, world, 0, 400, dist.group.WORLD)


@pytest.mark.parametrize("world", [2, 4])
def test_ranks_racing_ahead_get_every_sum_right(ranks, world):
    assert ranks(race, world, world_size=world) == [[]] * world


def interrupted(rank: int, world: int, stage: str, how: str) -> dict:
    """Cell 1: sums until the victim (last rank) is interrupted at `stage` of sum 7, which also interrupts
    every peer (the stop button reaches every rank) once they wait in a sum the victim must join; a barrier;
    cell 2: sums that must all be right."""
    import torch.distributed as dist

    group, victim = dist.group.WORLD, world - 1
    handled = threading.Event()

    def on_sigint(signum, frame):
        if not handled.is_set():
            handled.set()
            raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    sums = shared_sum(group)
    victim_call = sums._words[sums._mine] + 7  # sum 7 of cell 1
    injected = []

    def hook(at: str, call: int) -> None:
        if at != stage or injected:
            return
        if call == victim_call:
            injected.append(call)
            # Interrupt when every peer is stuck in a sum: at this call before the victim published it, else
            # at the next one (the peers can read this call, then wait for the victim's next).
            peers_at = call if at in ("start", "copied") else call + 1
            deadline = time.monotonic() + INTERRUPT_DEADLINE_S
            while min(sums._words[r * host_sum.LINE_WORDS] for r in range(world - 1)) < peers_at:
                assert time.monotonic() < deadline, f"the peers never reached sum {peers_at}"
                time.sleep(1e-3)
            for peer in range(world - 1):
                os.kill(sums.pids[peer], signal.SIGINT)
            if how == "signal":
                signal.raise_signal(signal.SIGINT)
            else:
                handled.set()
                raise KeyboardInterrupt

    if rank == victim:
        HostSum.stage_hook = staticmethod(hook)
    outcome = None
    try:
        try:
            sums_in_a_row(rank, world, 0, 40, group)
        except SumAbandoned:
            outcome = "SumAbandoned"
        deadline = time.monotonic() + INTERRUPT_DEADLINE_S
        while not handled.is_set() and time.monotonic() < deadline:
            handled.wait(0.05)
    except KeyboardInterrupt:
        outcome = outcome or "KeyboardInterrupt"
    HostSum.stage_hook = None
    dist.barrier(group)  # the next cell
    wrong = sums_in_a_row(rank, world, 100, 30, group)
    return {"outcome": outcome, "interrupted": handled.is_set(), "injected": injected, "wrong": wrong}


@pytest.mark.parametrize(
    ("stage", "how", "world"),
    [(s, h, 2) for s in ("start", "copied", "published", "read") for h in ("raise", "signal")]
    + [("published", "raise", 4), ("copied", "signal", 4)],
)
def test_an_interrupt_at_any_stage_stops_every_rank_and_the_next_cell_sums_right(ranks, stage, how, world):
    outcomes = ranks(interrupted, world, stage, how, world_size=world)
    assert outcomes[-1]["injected"], "the victim should have been interrupted during cell 1"
    for rank, outcome in enumerate(outcomes):
        assert outcome["interrupted"], f"rank {rank} never got its interrupt"
        assert outcome["outcome"] in ("KeyboardInterrupt", "SumAbandoned"), (rank, outcome)
        assert outcome["wrong"] == [], f"rank {rank}: wrong sums after the interrupt: {outcome['wrong']}"


def mismatched(rank: int, what: str) -> dict:
    import torch.distributed as dist

    sums = shared_sum(dist.group.WORLD)
    dtype = [torch.float32, torch.int64][rank] if what == "dtype" else torch.float32
    tensor = torch.ones(8 if what == "size" and rank == 1 else 4, dtype=dtype)
    try:
        sums.sum_(tensor)
        error = None
    except SumMismatch as e:
        error = str(e)
    except SumAbandoned as e:  # the peer found the mismatch first and left
        error = "abandoned: " + str(e)
    dist.barrier()
    return {"error": error, "then": sums.sum_(torch.full((4,), float(rank + 1))).tolist()}


@pytest.mark.parametrize("what", ["size", "dtype"])
def test_ranks_summing_different_tensors_get_a_clear_error(ranks, what):
    first, second = ranks(mismatched, what)
    named = {"size": "rank 0: call 1, 4 x float32, rank 1: call 1, 8 x float32", "dtype": "1, 4 x int64"}[what]
    assert any(named in (o["error"] or "") for o in (first, second)), (first, second)
    for outcome in (first, second):
        assert outcome["error"] is not None, "a mismatch must raise on every rank"
        assert outcome["then"] == [3.0] * 4, "the next sum must be right"


def set_up_in(rank: int) -> dict:
    """Set up a group's sums in $SHARDBOOK_SHM_DIR; rank 1 looks at the segment before mapping it."""
    import torch.distributed as dist

    from shardbook.rankd.parallel.tp_modules import all_reduce

    os.umask(0o022)
    seen, real_map = {}, host_sum._map

    def looking(path: str, size: int):
        seen["mode"] = stat.S_IMODE(os.stat(path).st_mode)
        return real_map(path, size)

    host_sum._map = looking
    records: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: records.append(record.getMessage())
    logging.getLogger(host_sum.__name__).addHandler(handler)
    tensor = torch.full((1 << 18,), float(rank + 1))  # 1 MiB: beyond a 1 MiB tmpfs
    all_reduce(tensor, dist.group.WORLD)
    dist.barrier()
    return {
        "shared": host_sum.host_sum_for(dist.group.WORLD) is not None,
        "right": bool(torch.all(tensor == 3.0)),
        "mode": seen.get("mode"),
        "left_behind": sorted(p.name for p in Path(os.environ[host_sum.DIR_ENV]).iterdir()),
        "log": records,
    }


def test_the_segment_is_private_and_unlinked(ranks, tmp_path, monkeypatch):
    monkeypatch.setenv(host_sum.DIR_ENV, str(tmp_path))
    first, second = ranks(set_up_in)
    assert first["shared"] and second["shared"] and first["right"] and second["right"]
    assert second["mode"] == 0o600, f"mode {oct(second['mode'] or 0)}"
    assert first["left_behind"] == [] and second["left_behind"] == []


@pytest.fixture
def small_tmpfs(tmp_path):
    where = tmp_path / "shm"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode != 0:
        why = f"cannot mount a 1 MiB tmpfs here ({mounted.stderr.decode().strip()}): needs root"
        if os.environ.get("CI") == "true":
            pytest.fail(why)
        pytest.skip(why)
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_full_tmpfs_falls_back_to_gloo_with_the_reason(ranks, small_tmpfs, monkeypatch):
    monkeypatch.setenv(host_sum.DIR_ENV, str(small_tmpfs))
    first, second = ranks(set_up_in)
    assert not first["shared"] and not second["shared"], "a segment larger than the tmpfs must not be used"
    assert first["right"] and second["right"]
    assert any("no room" in line and "gloo" in line for line in first["log"]), first["log"]
    assert first["left_behind"] == []


def test_an_existing_file_or_link_is_never_taken_over(tmp_path):
    planted = tmp_path / "planted"
    planted.write_bytes(b"someone else's")
    with pytest.raises(FileExistsError):
        host_sum._create(planted, host_sum.segment_bytes(2))
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "target")
    with pytest.raises(FileExistsError):
        host_sum._create(link, host_sum.segment_bytes(2))
    assert planted.read_bytes() == b"someone else's" and not (tmp_path / "target").exists()


def segments_mapped() -> int:
    with open("/proc/self/maps") as f:
        return len(set(re.findall(r"shardbook-sum-[0-9a-f]+", f.read())))


def restarted(rank: int, where: str) -> list[int]:
    """Sum, destroy the process group, start a new one and sum again: how many segments are mapped each time."""
    import torch.distributed as dist

    counts = []
    shared_sum(dist.group.WORLD).sum_(torch.ones(4))
    counts.append(segments_mapped())
    dist.destroy_process_group()
    dist.init_process_group("gloo", init_method=f"file://{where}/second-store", rank=rank, world_size=2)
    shared_sum(dist.group.WORLD).sum_(torch.ones(4))
    counts.append(segments_mapped())
    return counts


def test_a_new_world_releases_the_old_worlds_segment(ranks, tmp_path):
    assert ranks(restarted, str(tmp_path)) == [[1, 1], [1, 1]]
