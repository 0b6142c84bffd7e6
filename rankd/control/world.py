"""World set-up for every rank: device and backend detection, the process group, the job's shape.

Every rank of a shardbook job calls :func:`init_world` once at start-up. Outside torchrun
(a plain IPython kernel) the same call gives a world of one rank, so all code paths are the same.
"""

from __future__ import annotations

import atexit
import datetime
import importlib.util
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from shardbook.rankd.control import startup_notes

log = logging.getLogger(__name__)

DEVICE_CHOICES = ("auto", "cpu", "cuda", "npu")
CONNECT_TIMEOUT_S = float(os.environ.get("SHARDBOOK_CONNECT_TIMEOUT", "120"))
"""How long ranks wait for each other at start-up (store rendezvous, rank 0's endpoint, every follower)."""
BACKEND_FOR_DEVICE = {"cpu": "gloo", "cuda": "cuda:nccl,cpu:gloo", "npu": "npu:hccl,cpu:gloo"}


@dataclass(frozen=True)
class JobShape:
    """Where this process sits in the torchrun job (read from torchrun's environment)."""

    rank: int = 0
    """Global rank of this process."""
    world_size: int = 1
    """Number of ranks in the job."""
    local_rank: int = 0
    """Rank within this node; selects the device."""
    local_world_size: int = 1
    """Number of ranks on this node."""
    under_torchrun: bool = False
    """True when torchrun started this process (its environment variables are set)."""

    @property
    def single_node(self) -> bool:
        """True when every rank runs on this machine: the control plane then stays on loopback."""
        return self.world_size == self.local_world_size

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> JobShape:
        env = os.environ if env is None else env
        if "RANK" not in env or "WORLD_SIZE" not in env:
            return cls()
        return cls(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            local_world_size=int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
            under_torchrun=True,
        )


@dataclass(frozen=True)
class DeviceProbe:
    """The device functions :func:`detect_device` consults; tests replace them (no NPU here)."""

    npu_count: Callable[[], int]
    cuda_count: Callable[[], int]

    @classmethod
    def real(cls) -> DeviceProbe:
        return cls(npu_count=_npu_device_count, cuda_count=_cuda_device_count)


def _npu_device_count() -> int:
    """Number of Ascend NPUs; 0 when torch_npu is not installed (it is imported only if present)."""
    try:
        import torch_npu  # noqa: F401  (registers torch.npu)
    except ImportError:
        return 0
    import torch

    try:
        return int(torch.npu.device_count())
    except Exception as e:  # a broken driver install must not hide the CUDA/CPU fallback
        log.warning("torch_npu is installed but reports no usable NPU (%s); falling back", e)
        return 0


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def require_device_extra(requested: str) -> None:
    """ValueError in one line naming the ``npu`` extra when device npu is asked for and torch_npu is not installed."""
    if requested == "npu" and importlib.util.find_spec("torch_npu") is None:
        raise ValueError(
            "device 'npu' was requested but torch_npu is not installed: pip install 'shardbook[npu]' "
            "(or the torch_npu build matching your CANN), or use --parallel.device auto"
        )


def detect_device(requested: str = "auto", probe: DeviceProbe | None = None) -> str:
    """Device type for this job: npu if torch_npu has devices, else cuda, else cpu.

    ``requested`` (``parallel.device`` or ``SHARDBOOK_DEVICE``) overrides the detection; asking for
    a device type that is absent is an error rather than a silent fallback.
    """
    if requested not in DEVICE_CHOICES:
        raise ValueError(f"unknown device {requested!r}; choose one of {', '.join(DEVICE_CHOICES)}")
    if requested == "cpu":
        return "cpu"
    if probe is None:
        require_device_extra(requested)
        probe = DeviceProbe.real()
    counts = {"npu": probe.npu_count, "cuda": probe.cuda_count}
    if requested != "auto":
        if counts[requested]() == 0:
            raise ValueError(
                f"device {requested!r} was requested but none is available on {socket.gethostname()}; "
                "use --parallel.device auto (or cpu) or run on a machine with that accelerator"
            )
        return requested
    for kind in ("npu", "cuda"):
        if counts[kind]() > 0:
            return kind
    return "cpu"


def device_for_rank(device_type: str, local_rank: int, probe: DeviceProbe | None = None) -> str:
    """``cuda:3`` style device string for this rank: each rank on its LOCAL_RANK device."""
    if device_type == "cpu":
        return "cpu"
    probe = probe or DeviceProbe.real()
    count = probe.npu_count() if device_type == "npu" else probe.cuda_count()
    if local_rank >= count:
        raise ValueError(
            f"local rank {local_rank} needs {device_type}:{local_rank} but this node has {count} "
            f"{device_type} device(s); start fewer ranks per node (--nproc {count})"
        )
    return f"{device_type}:{local_rank}"


@dataclass
class World:
    """This rank's view of the job: shape, device, backend and the default process group."""

    shape: JobShape
    device_type: str
    device: str
    backend: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = field(default_factory=os.getpid)
    store: Any = None

    @property
    def rank(self) -> int:
        return self.shape.rank

    @property
    def world_size(self) -> int:
        return self.shape.world_size

    def describe(self) -> dict[str, Any]:
        """The static facts ``%dist`` shows for this rank."""
        facts = {"rank": self.rank, "host": self.host, "pid": self.pid, "device": self.device, "backend": self.backend}
        return {**facts, "slurm": slurm_place()}


SLURM_NOTE_ENV = "SHARDBOOK_SLURM_NOTE"
"""Set by the Slurm step: how long the job waited in the queue and why, and where it runs (one line)."""


def slurm_note() -> str:
    return os.environ.get(SLURM_NOTE_ENV, "")


def slurm_place() -> str:
    """``NODE job JOBID`` under a Slurm step (``%dist`` shows it), else ``""``."""
    node, job = os.environ.get("SLURMD_NODENAME"), os.environ.get("SLURM_JOB_ID")
    return f"{node} job {job}" if node and job else ""


def process_group_timeout() -> datetime.timedelta:
    """Collective timeout: ``SHARDBOOK_PG_TIMEOUT`` seconds (default 1800, as torch's default)."""
    return datetime.timedelta(seconds=float(os.environ.get("SHARDBOOK_PG_TIMEOUT", "1800")))


def set_current_device(device: Any) -> None:
    """Make ``device`` (``cuda:1``, a ``torch.device``) current in the calling thread.

    Accelerators track the current device per thread, and a new thread starts on device 0: the
    main thread at start-up and every thread that runs model code on a rank call this.
    """
    import torch

    device = torch.device(device)
    if device.type != "cpu":
        torch.get_device_module(device.type).set_device(device)


STARTUP_FAILED_KEY = "shardbook/startup_failed"
"""Store key a rank sets when it gives up waiting: ranks that arrive later leave instead of hanging."""
STARTUP_ERROR_KEY = "shardbook/startup_error"
"""Store keys (a count, then one per rank) of ranks that failed before they arrived, each with its error."""


class StartupAbandoned(RuntimeError):
    """Start-up failed elsewhere and rank 0 reports it: this rank should leave quietly (exit status 0)."""


def report_startup_failure(shape: JobShape, text: str) -> bool:
    """Tell the job (rank 0 first, which reports it) that this rank cannot start, and why.

    A rank on rank 0's node, or on any node when the launcher named a folder every node shares (Slurm), leaves
    a note (:mod:`.startup_notes`), which needs neither torch nor the store; a rank on another node reports
    through the store. False when neither can be done (on another node with no shared folder, torch itself
    failed to import, or rank 0 never opened its store): this rank's own log line is then the only report.
    """
    if startup_notes.leave_note(shape.rank, text):
        return True
    try:
        store = job_store(shape)
        store.set(f"{STARTUP_ERROR_KEY}/{shape.rank}", text)
        store.add(STARTUP_ERROR_KEY, 1)
    except Exception as e:  # whatever stops the report, the rank's own failure is the one to show
        log.warning("rank %d could not tell rank 0 why it failed (%s: %s)", shape.rank, type(e).__name__, e)
        return False
    return True


def startup_errors(store: Any, world_size: int) -> str | None:
    """The start-up failures ranks reported, through the store or in a note on this node (each distinct error
    once, with its ranks), or None if none did."""
    reported = startup_notes.read_notes(world_size)
    if store.add(STARTUP_ERROR_KEY, 0):
        for r in range(world_size):
            key = f"{STARTUP_ERROR_KEY}/{r}"
            if store.check([key]):
                reported[r] = store.get(key).decode()
    if not reported:
        return None
    errors: dict[str, list[int]] = {}
    for r, error in sorted(reported.items()):
        errors.setdefault(error, []).append(r)
    parts = [
        f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} of {world_size} failed at start-up: {error}"
        for error, ranks in errors.items()
    ]
    return "; ".join(parts) + " (the Jupyter server's log has the traceback)"


def wait_for_every_rank(store: Any, world_size: int, rank: int | None = None) -> None:
    """Block until every rank has arrived, under ``SHARDBOOK_CONNECT_TIMEOUT`` (default 120 s).

    The process group connects its ranks under the *collective* timeout, which people may set
    to a few seconds; on a busy machine ranks start further apart than that. Arriving here first,
    under the generous start-up deadline, keeps the two concerns apart. A rank that gives up says
    so in the store; a rank arriving after that raises :class:`StartupAbandoned` rather than wait
    in the process group's rendezvous for ranks that have moved on. A rank that failed before it
    arrived (:func:`report_startup_failure`) ends the wait at once, naming it and its error. Rank 0
    raises the failure (the kernel reports it); the other ranks leave with :class:`StartupAbandoned`,
    since a follower's failed exit would make the launcher end the kernel before it could say why.
    """
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    if rank == 0:  # the notes of followers that fail later are no longer read
        atexit.register(startup_notes.clear_notes)
    if rank is not None:
        store.set(f"shardbook/arrived/{rank}", "1")  # who arrived, so a failure can name who did not
    store.add("shardbook/arrived", 1)
    while store.add("shardbook/arrived", 0) < world_size:
        text = startup_errors(store, world_size)
        if text is None and time.monotonic() > deadline:
            missing = [r for r in range(world_size) if not store.check([f"shardbook/arrived/{r}"])]
            which = ", ".join(map(str, missing)) or "unknown"
            text = (
                f"rank{'s' if len(missing) != 1 else ''} {which} of {world_size} did not start within "
                "SHARDBOOK_CONNECT_TIMEOUT; check the logs of the missing rank(s) (a node that never started, "
                "an import error) and restart"
            )
        if text is not None:
            store.set(STARTUP_FAILED_KEY, text)
            if rank:  # a follower: rank 0 reports it
                raise StartupAbandoned(text)
            raise RuntimeError(text)
        time.sleep(0.02)
    if store.check([STARTUP_FAILED_KEY]):
        raise StartupAbandoned(
            f"arrived too late: another rank already gave up ({store.get(STARTUP_FAILED_KEY).decode()})"
        )


def job_store(shape: JobShape) -> Any:
    """The job's key-value store: torchrun's own (its agent hosts it), or one that rank 0 hosts.

    Under shardbook's one-node launcher (``kernel/cli/localrun.py``) rank 0 hosts the store at
    ``MASTER_ADDR:MASTER_PORT``. It does not wait there for the others to connect (torch's ``env://``
    would, with no deadline a person sets): :func:`wait_for_every_rank` waits for them under the
    start-up deadline and names a rank that never came. The store lives as long as the process, even
    when start-up failed: a rank that arrives later must still find out that it was abandoned.
    """
    import torch.distributed as dist

    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        return next(dist.rendezvous("env://"))[0]
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    if shape.rank != 0:
        wait_for_listener(host, port)
    store = dist.TCPStore(
        host,
        port,
        shape.world_size,
        is_master=shape.rank == 0,
        timeout=dist.constants.default_pg_timeout,  # as env:// had: a follower may start long before rank 0's store
        wait_for_workers=False,
        multi_tenant=True,
    )
    _stores_kept.append(store)
    return store


def wait_for_listener(host: str, port: int, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Block until ``host:port`` accepts connections (polled every 20 ms), under the start-up deadline.

    Followers start before rank 0's store is up (rank 0 also sets up the kernel). The store's own
    client retries with a random back-off of up to seconds, which would add that to every start.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection((host, port), timeout=1.0).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"rank 0 did not open the job's store at {host}:{port} within SHARDBOOK_CONNECT_TIMEOUT "
                    f"({timeout_s:.0f} s); check rank 0's log (the Jupyter server's) for why it did not start"
                ) from None
            time.sleep(0.02)


_stores_kept: list[Any] = []
"""The store this process hosts (see :func:`job_store`): freeing it would stop its server."""


def init_world(requested_device: str | None = None, shape: JobShape | None = None) -> World:
    """Detect the device, set it for this rank and join the default process group.

    Under torchrun the rendezvous comes from torchrun's environment (``env://``); outside it a
    one-rank gloo group on a private in-memory store is created, so collectives still work.
    """
    import torch.distributed as dist

    shape = shape or JobShape.from_env()
    device_type = detect_device(requested_device or os.environ.get("SHARDBOOK_DEVICE", "auto"))
    device = device_for_rank(device_type, shape.local_rank)
    set_current_device(device)
    backend = BACKEND_FOR_DEVICE[device_type]
    if not dist.is_initialized():
        if shape.under_torchrun:
            store = job_store(shape)
            wait_for_every_rank(store, shape.world_size, shape.rank)
            dist.init_process_group(
                backend=backend,
                store=store,
                rank=shape.rank,
                world_size=shape.world_size,
                timeout=process_group_timeout(),
            )
        else:
            dist.init_process_group(
                backend=backend, store=dist.HashStore(), rank=0, world_size=1, timeout=process_group_timeout()
            )
    store = dist.distributed_c10d._get_default_store()
    log.debug("rank %d/%d on %s (%s)", shape.rank, shape.world_size, device, backend)
    return World(shape=shape, device_type=device_type, device=device, backend=backend, store=store)


def memory_in_use(device: str) -> dict[str, int]:
    """Resident memory of this process and, on an accelerator, the bytes allocated on its device."""
    memory = {"rss": _resident_bytes()}
    if device.startswith("cuda"):
        import torch

        memory["device"] = int(torch.cuda.memory_allocated(device))
    elif device.startswith("npu"):
        import torch

        memory["device"] = int(torch.npu.memory_allocated(device))
    return memory


def _resident_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def load_device(requested: str, world: World) -> str:
    """The device a model is loaded on: the rank's own, or ``cpu`` (gloo is in every backend).

    The accelerator type is fixed when the ranks start (it picks the process-group backend), so
    asking for another accelerator at load time is an error that says how to restart on it.
    """
    if requested in ("auto", world.device_type):
        return world.device
    if requested == "cpu":
        return "cpu"
    raise ValueError(
        f"parallel.device={requested!r} but this kernel's ranks run on {world.device_type} (chosen when they "
        f"started). Reinstall the kernel with `shardbook install ... --env SHARDBOOK_DEVICE={requested}` and "
        "restart it, or use --parallel.device auto"
    )
