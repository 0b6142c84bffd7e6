"""Sums over a group whose ranks share one x86-64 host, through shared memory instead of gloo's TCP.

Why: on CPU (gloo) a `tp` decode step is bound by its collectives. SmolLM2 makes 61 small all-reduces per
token; over gloo each is a loopback TCP exchange that wakes a blocked thread, 0.26 ms on an idle 2-core
machine and 0.9-1.7 ms while a server and its clients share the cores. Here each rank copies its tensor
into its own slot of a shared mapping, publishes a counter, spins until every rank's counter has
arrived, and adds the slots in rank order, so every rank gets the same bits.

The protocol needs no second barrier: slots alternate between two buffers by call number, and a rank
publishes call `n + 1` only after reading call `n`, so by the time anyone writes buffer `n % 2` again
(call `n + 2`) every rank has read it. A rank's call number is its published counter plus one, read
from the mapping, so an exception between two bytecodes (an interrupt) leaves it either published or
not, never half-way. That is also why only x86-64 takes this path: its stores become visible to other
cores in program order (a slot's bytes before the counter), which Python cannot ask for elsewhere.

Eligible groups are decided once, collectively, at their first sum: the backend is gloo, every rank
sees the same host (boot id and PID namespace) and the same mapping. Anything else, tensors larger than
a slot, other reductions, and `SHARDBOOK_HOST_SUM=0`, uses `torch.distributed` as before.
"""

from __future__ import annotations

import mmap
import os
import platform
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from shardbook.rankd.control.lifetime import pid_alive
from shardbook.rankd.control.world import process_group_timeout

SLOT_BYTES = 4 << 20
"""Largest tensor summed here: a decode step's activations and 512-token prefill chunks of a 2k-wide model."""
COUNTER_STRIDE = 64
"""Each rank's counter sits on its own cache line, so one rank's writes do not slow another's spinning."""
COUNTER_WORDS = COUNTER_STRIDE // 8
SPIN_S = 50e-6
"""Pure spinning before yielding the core: a peer in the same forward usually arrives within this."""
YIELD_S = 5e-3
"""Then yield the core between checks; after this, sleep between checks (a peer busy elsewhere, a long prefill),
a hundredth of the time waited so far, from 50 us up to 1 ms, so a long wait costs its core little."""
LIVENESS_EVERY_S = 0.5
"""While sleeping, how often a rank checks that every peer process still exists."""
SWITCH = "SHARDBOOK_HOST_SUM"


class PeerGone(RuntimeError):
    """A peer of the group died, or never arrived within the process-group timeout."""


class HostSum:
    """Shared-memory sums over one group of ranks on one host (see the module docstring)."""

    def __init__(self, mapping: mmap.mmap, rank: int, pids: list[int]):
        self.rank, self.pids, self.world = rank, pids, len(pids)
        self._mapping = mapping
        header = COUNTER_STRIDE * self.world
        self._words = memoryview(mapping).cast("q")  # 8-byte words; rank r's counter is word r * COUNTER_WORDS
        self._mine = self.rank * COUNTER_WORDS
        slots = torch.frombuffer(mapping, dtype=torch.uint8, offset=header, count=2 * self.world * SLOT_BYTES)
        self.slots = slots.view(2, self.world, SLOT_BYTES)
        self._lock = threading.Lock()

    @staticmethod
    def fits(tensor: torch.Tensor) -> bool:
        return tensor.device.type == "cpu" and tensor.is_contiguous() and tensor.nbytes <= SLOT_BYTES

    def sum_(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` in place over the group: the same bits on every rank."""
        flat = tensor.view(-1)
        with self._lock:
            call = self._words[self._mine] + 1
            buffer = self.slots[call % 2]
            buffer[self.rank, : tensor.nbytes].copy_(flat.view(torch.uint8))
            self._words[self._mine] = call
            self._wait_for(call)
            parts = [buffer[r, : tensor.nbytes].view(tensor.dtype) for r in range(self.world)]
            torch.add(parts[0], parts[1], out=flat)
            for part in parts[2:]:
                flat.add_(part)
        return tensor

    def _wait_for(self, call: int) -> None:
        if self._slowest() >= call:
            return
        start = time.perf_counter()
        deadline = start + process_group_timeout().total_seconds()
        next_check = start + LIVENESS_EVERY_S
        while self._slowest() < call:
            now = time.perf_counter()
            if now - start < SPIN_S:
                continue
            if now - start < YIELD_S:
                os.sched_yield()
                continue
            if now >= next_check:
                self._check_peers(call, now >= deadline)
                next_check = now + LIVENESS_EVERY_S
            time.sleep(min(1e-3, max(50e-6, (now - start) / 100)))

    def _slowest(self) -> int:
        """The lowest counter: every rank has published at least this many sums."""
        words = self._words
        return min(words[r * COUNTER_WORDS] for r in range(self.world))

    def _check_peers(self, call: int, timed_out: bool) -> None:
        late = [r for r in range(self.world) if self._words[r * COUNTER_WORDS] < call]
        dead = [r for r in late if not pid_alive(self.pids[r])]
        if dead or timed_out:
            why = f"rank(s) {dead} of the group have exited" if dead else f"rank(s) {late} never arrived"
            raise PeerGone(
                f"a shared-memory sum over the tensor-parallel group failed: {why} (sum number {call}; a late "
                f"rank is waited for up to SHARDBOOK_PG_TIMEOUT, {process_group_timeout().total_seconds():.0f} s). "
                "The group cannot go on: restart the kernel (or the job). SHARDBOOK_HOST_SUM=0 sums over gloo instead."
            )


_SUMS: dict[int, tuple[dist.ProcessGroup, HostSum | None]] = {}
"""Per group (by id, the group kept alive beside it): its HostSum, or None where it is not eligible."""


def host_sum_for(group: dist.ProcessGroup) -> HostSum | None:
    """The group's shared-memory sum, set up at its first call (a collective: every rank of it calls this)."""
    known = _SUMS.get(id(group))
    if known is not None and known[0] is group:
        return known[1]
    host_sum = _set_up(group) if _wanted(group) else None
    _SUMS[id(group)] = (group, host_sum)
    return host_sum


def _wanted(group: dist.ProcessGroup) -> bool:
    """Decided alike on every rank: the switch, the platform and the backend are the same everywhere."""
    switch = os.environ.get(SWITCH, "1")
    if switch not in ("0", "1"):
        raise ValueError(f"{SWITCH}={switch!r}: use 1 (sum over shared memory where possible, the default) or 0 (gloo)")
    return switch == "1" and platform.machine().lower() in ("x86_64", "amd64") and dist.get_backend(group) == "gloo"


def _set_up(group: dist.ProcessGroup) -> HostSum | None:
    """Map one segment on every rank if all of them share a host and can see it; None (gloo) otherwise."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    size = COUNTER_STRIDE * world + 2 * world * SLOT_BYTES
    path = Path(_shm_dir()) / f"shardbook-sum-{uuid.uuid4().hex}" if rank == 0 else None
    if path is not None:
        _create(path, size)
    offer = [_host_identity(), str(path) if path else None, os.getpid()]
    offers: list = [None] * world
    dist.all_gather_object(offers, offer, group=group)
    shared_path = offers[0][1]
    same_host = all(o[0] == offers[0][0] for o in offers)
    mapping = _map(shared_path, size) if same_host and shared_path else None
    mapped = [None] * world
    dist.all_gather_object(mapped, mapping is not None, group=group)  # also: nobody unlinks before everyone mapped
    if path is not None:
        path.unlink(missing_ok=True)
    if not all(mapped):
        return None
    return HostSum(mapping, rank, [o[2] for o in offers])


def _shm_dir() -> str:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def _create(path: Path, size: int) -> None:
    with open(path, "wb") as f:
        f.truncate(size)


def _map(path: str, size: int) -> mmap.mmap | None:
    try:
        with open(path, "r+b") as f:
            return mmap.mmap(f.fileno(), size)
    except OSError:
        return None


def _host_identity() -> tuple[str, str, str]:
    """Same tuple on two ranks: same machine, same boot, same PID namespace (so peers' PIDs can be checked)."""
    boot = Path("/proc/sys/kernel/random/boot_id")
    try:
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        pid_ns = ""
    return socket.gethostname(), boot.read_text().strip() if boot.exists() else "", pid_ns
