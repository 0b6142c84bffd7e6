"""Sums over a group whose ranks share one x86-64 host, through shared memory instead of gloo's TCP.

Why: on CPU (gloo) a `tp` decode step is bound by its collectives. SmolLM2 makes 61 small all-reduces per
token; over gloo each is a loopback TCP exchange that wakes a blocked thread, 0.26 ms on an idle 2-core
machine and 0.9-1.7 ms while a server and its clients share the cores. Here each rank copies its tensor
into its own slot of a shared mapping, publishes a counter, spins until every rank's counter has
arrived, and adds the slots in rank order, so every rank gets the same bits.

The protocol needs no second barrier: slots alternate between two buffers by call number, and a rank
publishes call `n + 1` only after reading call `n`, so by the time anyone writes buffer `n % 2` again
(call `n + 2`) every rank has read it. Only x86-64 takes this path: its stores become visible to other
cores in program order (a slot's bytes before the counter), which Python cannot ask for elsewhere.
Each slot carries its call number, byte count and dtype, and every reader checks them: ranks that sum
different tensors get an error naming both, never a silently wrong sum.

A sum left half-way would break the pairing of call `n` on every rank. So in the main thread the
interrupt signals are held off for the length of a sum (their handlers run while it waits for a peer,
and at its end), and a sum that raises anyway (an interrupt while waiting, an asynchronous exception
in another thread, an error) *abandons* it: it raises the segment's epoch, which every peer's wait sees
at once (it raises too, instead of waiting for a rank that left), and says it is out. The next sum on
every rank re-synchronises first: it waits until every rank is out of the old epoch's sums, then all
go on from the highest call number any rank reached. An interrupted cell therefore stops on every rank
it reaches and the next cell sums correctly.

Eligible groups are decided once, collectively, at their first sum: the backend is gloo, every rank
sees the same host (boot id and PID namespace) and the same mapping. The segment is created 0600 with
O_EXCL, its space reserved (a full tmpfs would kill a rank with SIGBUS at its first large copy), and
unlinked once every rank has mapped it. Any failure there, tensors larger than a slot, other reductions,
and `SHARDBOOK_HOST_SUM=0`, use `torch.distributed` as before.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import platform
import socket
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist

from shardbook.rankd.control.channel import DeferredInterrupts
from shardbook.rankd.control.lifetime import pid_alive
from shardbook.rankd.control.world import process_group_timeout

log = logging.getLogger(__name__)

SLOT_BYTES = 4 << 20
"""Largest tensor summed here: a decode step's activations and 512-token prefill chunks of a 2k-wide model."""
LINE_BYTES = 64
"""Each rank's words sit on a cache line of their own, so one rank's writes do not slow another's spinning."""
LINE_WORDS = LINE_BYTES // 8
# Rank r's line, in 8-byte words: its published counter, the epoch and counter it said it left at, and per
# buffer the call number and shape (bytes << 8 | dtype code) of what it wrote there. One more line after
# the ranks' holds the segment's epoch and who abandoned its last sum, at which call, and why.
COUNTER, OUT_EPOCH, OUT_COUNTER = 0, 1, 2
STAMP = (4, 6)
SHAPE = (5, 7)
EPOCH, ABANDONED_BY, ABANDONED_AT, ABANDONED_WHY = 0, 1, 2, 3
SPIN_S = 50e-6
"""Pure spinning before yielding the core: a peer in the same forward usually arrives within this."""
YIELD_S = 5e-3
"""Then yield the core between checks; after this, sleep between checks (a peer busy elsewhere, a long prefill),
a hundredth of the time waited so far, from 50 us up to 1 ms, so a long wait costs its core little."""
LIVENESS_EVERY_S = 0.5
"""While sleeping, how often a rank checks that every peer process still exists."""
SWITCH = "SHARDBOOK_HOST_SUM"
DIR_ENV = "SHARDBOOK_SHM_DIR"
"""Where the segment is made: /dev/shm by default (the temporary directory where it is not writable)."""
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.int8)
DTYPE_CODES = {dtype: code for code, dtype in enumerate(DTYPES, start=1)}
WHY = ("", "KeyboardInterrupt", "an error")


class PeerGone(RuntimeError):
    """A peer of the group died, or never arrived within the process-group timeout."""


class SumAbandoned(RuntimeError):
    """Another rank left the sum this rank waits in (interrupted, or failed): this rank stops its work too."""


class SumMismatch(ValueError):
    """The ranks summed tensors of different sizes or dtypes, or different calls: they do not run the same code."""


def segment_bytes(world: int) -> int:
    return LINE_BYTES * (world + 1) + 2 * world * SLOT_BYTES


class HostSum:
    """Shared-memory sums over one group of ranks on one host (see the module docstring)."""

    stage_hook: Callable[[str, int], None] | None = None
    """Tests only: called as `hook(stage, call)` at each stage of a sum ("start", "copied", "published", "read")."""

    def __init__(self, mapping: mmap.mmap, rank: int, pids: list[int]):
        self.rank, self.pids, self.world = rank, pids, len(pids)
        self._mapping = mapping
        self._words = memoryview(mapping).cast("q")  # 8-byte words: rank r's line starts at word r * LINE_WORDS
        self._mine = self.rank * LINE_WORDS
        self._shared = self.world * LINE_WORDS
        offset, count = LINE_BYTES * (self.world + 1), 2 * self.world * SLOT_BYTES
        self.slots = torch.frombuffer(mapping, dtype=torch.uint8, offset=offset, count=count).view(2, self.world, -1)
        self.epoch = 0
        self._ranks = range(self.world)
        self._lock = threading.Lock()

    @staticmethod
    def fits(tensor: torch.Tensor) -> bool:
        return (
            tensor.device.type == "cpu"
            and tensor.is_contiguous()
            and tensor.nbytes <= SLOT_BYTES
            and tensor.dtype in DTYPE_CODES
        )

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the group: the same bits on every rank."""
        flat, words, mine, hook = tensor.view(-1), self._words, self._mine, self.stage_hook
        shape = tensor.nbytes << 8 | DTYPE_CODES[tensor.dtype]
        with self._lock, DeferredInterrupts() as held:
            if words[self._shared + EPOCH] != self.epoch:
                self._resync(held)
            call = words[mine + COUNTER] + 1
            buffer, which = self.slots[call % 2], call % 2
            try:
                hook and hook("start", call)
                buffer[self.rank, : tensor.nbytes].copy_(flat.view(torch.uint8))
                words[mine + SHAPE[which]] = shape
                words[mine + STAMP[which]] = call
                hook and hook("copied", call)
                words[mine + COUNTER] = call
                hook and hook("published", call)
                self._wait_for(call, held)
                self._check_slots(call, which, shape)
                parts = [buffer[r, : tensor.nbytes].view(tensor.dtype) for r in range(self.world)]
                torch.add(parts[0], parts[1], out=flat)
                for part in parts[2:]:
                    flat.add_(part)
                self._check_slots(call, which, shape)  # nobody wrote this buffer again while it was read
                hook and hook("read", call)
            except BaseException as e:
                self._abandon(call, e)
                raise
        return tensor

    def _check_slots(self, call: int, which: int, shape: int) -> None:
        words = self._words
        stamps = [words[r * LINE_WORDS + STAMP[which]] for r in range(self.world)]
        shapes = [words[r * LINE_WORDS + SHAPE[which]] for r in range(self.world)]
        if stamps == [call] * self.world and shapes == [shape] * self.world:
            return
        what = ", ".join(f"rank {r}: call {s}, {_describe(shapes[r])}" for r, s in enumerate(stamps))
        raise SumMismatch(
            f"the ranks of the tensor-parallel group summed different tensors through shared memory ({what}): "
            "every rank must run the same code on the same shapes (gloo would refuse this sum too)"
        )

    def _abandon(self, call: int, error: BaseException) -> None:
        """Leave this sum: raise the segment's epoch (unless a peer did) and say at which counter this rank is out."""
        words, shared = self._words, self._shared
        if words[shared + EPOCH] == self.epoch:
            words[shared + ABANDONED_BY] = self.rank
            words[shared + ABANDONED_AT] = call
            words[shared + ABANDONED_WHY] = 1 if isinstance(error, KeyboardInterrupt) else 2
            words[shared + EPOCH] = self.epoch + 1
        self._say_out()

    def _say_out(self) -> None:
        words, mine = self._words, self._mine
        words[mine + OUT_COUNTER] = words[mine + COUNTER]
        words[mine + OUT_EPOCH] = words[self._shared + EPOCH]

    def _resync(self, held: DeferredInterrupts) -> None:
        """After an abandoned sum: wait until every rank is out of the old epoch, then go on from the highest call."""
        words = self._words
        while True:
            epoch = words[self._shared + EPOCH]
            self._say_out()
            self._wait(lambda epoch=epoch: all(words[r * LINE_WORDS + OUT_EPOCH] >= epoch for r in self._ranks), held)
            if words[self._shared + EPOCH] != epoch:  # abandoned again meanwhile: wait for that epoch instead
                continue
            words[self._mine + COUNTER] = max(words[r * LINE_WORDS + OUT_COUNTER] for r in range(self.world))
            self.epoch = epoch
            return

    def _wait_for(self, call: int, held: DeferredInterrupts) -> None:
        words, epoch = self._words, self.epoch

        def arrived() -> bool:
            if min(words[r * LINE_WORDS + COUNTER] for r in range(self.world)) >= call:
                return True
            if words[self._shared + EPOCH] != epoch:
                raise SumAbandoned(self._abandoned_text())
            return False

        self._wait(arrived, held, call)

    def _wait(self, done: Callable[[], bool], held: DeferredInterrupts, call: int | None = None) -> None:
        if done():
            return
        start = time.perf_counter()
        deadline = start + process_group_timeout().total_seconds()
        next_check = start + LIVENESS_EVERY_S
        while not done():
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            held.run_caught()  # an interrupt's handler may raise here: this rank then abandons the sum
            if now - start < YIELD_S:
                os.sched_yield()
                continue
            if now >= next_check:
                self._check_peers(call, now >= deadline)
                next_check = now + LIVENESS_EVERY_S
            time.sleep(min(1e-3, max(50e-6, (now - start) / 100)))

    def _abandoned_text(self) -> str:
        words, shared = self._words, self._shared
        who, at, why = words[shared + ABANDONED_BY], words[shared + ABANDONED_AT], words[shared + ABANDONED_WHY]
        return (
            f"rank {who} of the tensor-parallel group left shared-memory sum number {at} ({WHY[why]}), so this rank "
            "stops too; the next sum on every rank re-synchronises first, so the next cell works"
        )

    def _check_peers(self, call: int | None, timed_out: bool) -> None:
        words = self._words
        if call is None:  # re-synchronising: late are the ranks not yet out of the old epoch
            epoch = words[self._shared + EPOCH]
            late = [r for r in range(self.world) if words[r * LINE_WORDS + OUT_EPOCH] < epoch]
        else:
            late = [r for r in range(self.world) if words[r * LINE_WORDS + COUNTER] < call]
        dead = [r for r in late if not pid_alive(self.pids[r])]
        if dead or timed_out:
            why = f"rank(s) {dead} of the group have exited" if dead else f"rank(s) {late} never arrived"
            which = f"sum number {call}" if call is not None else "re-synchronising after an abandoned sum"
            raise PeerGone(
                f"a shared-memory sum over the tensor-parallel group failed: {why} ({which}; a late rank is waited "
                f"for up to SHARDBOOK_PG_TIMEOUT, {process_group_timeout().total_seconds():.0f} s). "
                "The group cannot go on: restart the kernel (or the job). SHARDBOOK_HOST_SUM=0 sums over gloo instead."
            )

    def close(self) -> None:
        """Unmap the segment (a tensor still viewing it keeps it mapped until that tensor is freed)."""
        self._words.release()
        del self.slots
        with contextlib.suppress(BufferError):
            self._mapping.close()


def _describe(shape: int) -> str:
    nbytes, code = shape >> 8, shape & 0xFF
    if not 0 < code <= len(DTYPES):
        return "nothing written"
    dtype = DTYPES[code - 1]
    return f"{nbytes // dtype.itemsize} x {str(dtype).removeprefix('torch.')}"


_SUMS: dict[int, tuple[dist.ProcessGroup, HostSum | None]] = {}
"""Per live group (by id, the group kept alive beside it): its HostSum, or None where it is not eligible."""


def host_sum_for(group: dist.ProcessGroup) -> HostSum | None:
    """The group's shared-memory sum, set up at its first call (a collective: every rank of it calls this)."""
    known = _SUMS.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    release_stale()
    host_sum = _set_up(group) if _wanted(group) else None
    _SUMS[id(group)] = (group, host_sum)
    return host_sum


def release_stale() -> None:
    """Unmap the segments of groups that no longer exist (a process group destroyed, a new world started)."""
    live = dist.distributed_c10d._world.pg_map if dist.is_initialized() else {}
    for key, (group, host_sum) in list(_SUMS.items()):
        if group not in live:
            del _SUMS[key]
            if host_sum is not None:
                host_sum.close()


def _wanted(group: dist.ProcessGroup) -> bool:
    """Decided alike on every rank: the switch, the platform and the backend are the same everywhere."""
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{SWITCH}={switch!r}: use 1 (sum over shared memory where possible, the default) or 0 (gloo)")
    return switch == "1" and platform.machine().lower() in ("x86_64", "amd64") and dist.get_backend(group) == "gloo"


def _set_up(group: dist.ProcessGroup) -> HostSum | None:
    """Map one segment on every rank if all of them share a host and can map it; None (gloo) otherwise.

    Every rank joins both all-gathers whatever failed locally, so the decision is the same everywhere.
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = segment_bytes(world)
    mapping, path, problem = None, None, None
    try:
        if rank == 0:
            path = Path(_shm_dir()) / f"shardbook-sum-{uuid.uuid4().hex}"
            mapping, problem = _attempt(lambda: _create(path, size), f"could not make the segment {path}", size)
        offers: list = [None] * world
        dist.all_gather_object(offers, [_host_identity(), str(path) if mapping else None, os.getpid()], group=group)
        if rank != 0 and offers[0][1] is not None:
            if offers[rank][0] != offers[0][0]:
                problem = "not on rank 0's host"
            else:
                mapping, problem = _attempt(lambda: _map(offers[0][1], size), "could not map rank 0's segment", size)
        problems: list = [None] * world
        dist.all_gather_object(problems, problem, group=group)  # also: nobody unlinks before everyone mapped
    finally:
        if path is not None:
            with contextlib.suppress(OSError):
                path.unlink(missing_ok=True)
    if offers[0][1] is None or any(problems):
        if mapping is not None:
            mapping.close()
        if rank == 0 and (problems[0] or any(p != "not on rank 0's host" for p in problems if p)):
            reasons = "; ".join(f"rank {r}: {p}" for r, p in enumerate(problems) if p)
            log.warning("rank %d: the tensor-parallel group sums over gloo, not shared memory (%s)", rank, reasons)
        return None
    return HostSum(mapping, rank, [o[2] for o in offers])


def _attempt(step: Callable[[], mmap.mmap], what: str, size: int) -> tuple[mmap.mmap | None, str | None]:
    try:
        return step(), None
    except OSError as e:
        if e.errno in (28, 122):  # ENOSPC, EDQUOT
            return None, (
                f"{what}: no room for its {size / 2**20:.0f} MiB ({e.strerror}); make /dev/shm larger "
                f"(docker run --shm-size, a Kubernetes memory emptyDir) or set {DIR_ENV} to a larger tmpfs"
            )
        return None, f"{what}: {e}"
    except Exception as e:  # any failure falls back to gloo: a sum must never depend on this path
        return None, f"{what}: {type(e).__name__}: {e}"


def _shm_dir() -> str:
    chosen = os.environ.get(DIR_ENV)
    if chosen:
        return chosen
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _create(path: Path, size: int) -> mmap.mmap:
    """A new file only this user can open (never an existing one, nor a link), its space reserved, mapped."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(fd, 0o600)  # whatever the umask
        os.posix_fallocate(fd, 0, size)  # pages reserved now: ENOSPC here, not SIGBUS at the first large copy
        return mmap.mmap(fd, size)
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)


def _map(path: str, size: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if os.fstat(fd).st_size < size:
            raise OSError(f"{path} is smaller than the {size} bytes expected")
        return mmap.mmap(fd, size)
    finally:
        os.close(fd)


def _host_identity() -> tuple[str, str, str]:
    """Same tuple on two ranks: same machine, same boot, same PID namespace (so peers' PIDs can be checked)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return socket.gethostname(), boot.read_text().strip() if boot.exists() else "", pid_ns
