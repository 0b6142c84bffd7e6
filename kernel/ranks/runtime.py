"""Rank 0's process-wide state: the world, the pool of ranks, and their start and end.

The magics, ``ChatModel`` and the kernel app all reach the same :class:`Runtime` through
:func:`get_runtime`. Under torchrun it joins the process group and connects the followers; in a
plain IPython session it is a world of one rank, so every feature works the same there.
"""

from __future__ import annotations

import atexit
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from shardbook.kernel.ranks.generation_queue import GenerationQueue
from shardbook.kernel.ranks.pool import Pool, PoolError
from shardbook.rankd.control import protocol
from shardbook.rankd.control.dispatch import RankContext
from shardbook.rankd.control.startup_marks import mark
from shardbook.rankd.control.world import CONNECT_TIMEOUT_S, JobShape, World, init_world, set_current_device

log = logging.getLogger(__name__)
_runtime: Runtime | None = None
_failure: str | None = None
"""Why the runtime failed to start, kept for the kernel's life: start-up is tried once."""
_lock = threading.Lock()
_starter: threading.Thread | None = None
"""The thread :func:`begin_runtime` started, until a caller has waited for it."""
_waiting = 0
"""How many callers of :func:`get_runtime` wait for that thread now."""
STARTING_NOTICE_S = 1.0
"""A cell that has waited this long for the ranks to start says so."""


class RunningServer(Protocol):
    """What the runtime needs of its HTTP server: to stop it when the kernel ends.

    Implemented by :class:`shardbook.kernel.server.server.Server`, a layer above this one.
    """

    url: str

    def stop(self) -> None: ...


@dataclass
class Runtime:
    """The world and pool rank 0 runs commands on, the line generations wait in, and the HTTP server if one runs."""

    world: World
    pool: Pool
    ctx0: RankContext
    generation_queue: GenerationQueue = field(default_factory=GenerationQueue)
    server: RunningServer | None = None
    """The running HTTP server (``%serve``, ``shardbook serve``), else None."""

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
        self.pool.shutdown()


def kernel_key(shell: Any) -> tuple[bytes, str]:
    """The control-plane key: an explicit key (multi-node jobs) or the kernel's connection key."""
    session = getattr(getattr(shell, "kernel", None), "session", None)
    return protocol.control_key(session=session) or (b"", "hmac-sha256")


def start_runtime(shell: Any, key: bytes | None = None, world: World | None = None) -> Runtime:
    """Join the job as rank 0 and wait (with a deadline) until every follower is connected.

    The terminal chat passes the ``world`` it has already joined and its own ``key``; the kernel
    passes neither, and the key is then :func:`kernel_key`'s.
    """
    shape = world.shape if world else JobShape.from_env()
    if shape.rank != 0:
        raise RuntimeError(f"the shardbook kernel must be rank 0, this process is rank {shape.rank}")
    world = world or init_world(shape=shape)
    mark("process group up")
    ctx0 = RankContext(world=world, shell=shell)
    session = (
        protocol.make_session(*((key, "hmac-sha256") if key else kernel_key(shell))) if world.world_size > 1 else None
    )
    pool = Pool(world, session, ctx0)
    runtime = Runtime(world, pool, ctx0)
    atexit.register(runtime.close)
    handle_sigterm(shape)
    try:
        pool.wait_connected()
    except BaseException:
        runtime.close()  # tell the followers that did connect to leave, and stop the channel's thread
        raise
    return runtime


def handle_sigterm(shape: JobShape) -> None:
    """Under a launcher, name a dead rank in the running cell when the launcher's SIGTERM comes (main thread only)."""
    if shape.under_torchrun and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)


def begin_runtime(shell: Any, on_end: Callable[[Runtime | None, str | None, bool], None]) -> None:
    """Start the runtime in a thread of its own, so the kernel answers its frontends while the ranks start.

    Joining the job waits for every rank, up to ``SHARDBOOK_CONNECT_TIMEOUT`` (120 s): done before
    ipykernel's loop started, it left ``kernel_info`` unanswered that long, and JupyterLab showed a
    kernel "starting" with no word why. ``on_end`` gets the runtime, or the failure's text, and whether
    a caller of :func:`get_runtime` is waiting (it then gets the failure itself), in that thread once the
    start has ended; :func:`get_runtime` waits for both.
    """
    global _starter

    def start() -> None:
        try:
            runtime, failure = _start_once(shell), None
        except PoolError as e:
            runtime, failure = None, str(e)
        on_end(runtime, failure, _waiting > 0)

    handle_sigterm(JobShape.from_env())
    _starter = threading.Thread(target=start, name="shardbook-start", daemon=True)
    _starter.start()


def get_runtime(shell: Any = None) -> Runtime:
    """The runtime, started on first use from ``shell`` (IPython's, when called from a magic).

    A start begun by :func:`begin_runtime` is waited for (it ends by its deadline; the stop button
    interrupts the wait). Start-up is tried once: a failure is kept and raised again at once by
    every later call (a second try would wait the whole connect timeout again, or join a half-made
    process group).
    """
    _wait_for_starter()
    return _start_once(shell)


def started_runtime() -> Runtime | None:
    """The runtime once it has started, else None (while it starts, or when it failed); never waits."""
    return _runtime


def _wait_for_starter() -> None:
    global _starter, _waiting
    starter = _starter
    if starter is None or starter is threading.current_thread():
        return
    starter.join(STARTING_NOTICE_S)
    if starter.is_alive():
        print(
            f"[shardbook] waiting for the ranks of this kernel to start (up to {CONNECT_TIMEOUT_S:.0f} s, "
            "SHARDBOOK_CONNECT_TIMEOUT); the stop button stops waiting",
            file=sys.stderr,
            flush=True,
        )
    _waiting += 1
    try:
        while starter.is_alive():
            starter.join(0.1)
    finally:
        _waiting -= 1
    _starter = None
    if _runtime is not None and threading.current_thread() is threading.main_thread():
        set_current_device(_runtime.world.device)  # as the start's thread did: cells run model code here


def _start_once(shell: Any) -> Runtime:
    global _runtime, _failure
    with _lock:
        if _failure is not None:
            raise PoolError(_failure)
        if _runtime is None:
            if shell is None:
                from IPython import get_ipython

                shell = get_ipython()
            try:
                _runtime = start_runtime(shell)
            except Exception as e:
                _failure = startup_failure(e)
                # The process's own stderr is the Jupyter server's log. Not logging: its default, sys.stderr, is
                # ipykernel's IOPub stream, into the running cell, where the magic waiting for the start says it.
                print(f"[shardbook rank 0] ERROR {_failure}", file=sys.__stderr__, flush=True)
                raise PoolError(_failure) from e
        return _runtime


def startup_failure(error: Exception) -> str:
    """The one paragraph every later magic shows when the pool failed to start."""
    cause = str(error).rstrip(". ") or type(error).__name__
    return (
        f"the rank pool of this kernel failed to start: {cause}. Nothing can run on the ranks of this kernel; "
        "fix the cause (the Jupyter server's log has every rank's output), then restart the kernel."
    )


def _on_sigterm(signum, frame) -> None:
    """The launcher ends every rank when one dies: say which rank died in the running cell, then go."""
    runtime = _runtime
    if runtime is not None:
        dead = runtime.pool.dead_ranks()
        reason = "; ".join(f"rank {s.rank} (pid {s.pid} on {s.host}): {s.dead_reason}" for s in dead)
        text = (
            f"{reason or 'a worker of this job stopped'}. Its launcher is ending every rank of the job, so this "
            "kernel is stopping too: restart the kernel to start a fresh pool."
        )
        log.error(text)
        for command in list(runtime.pool.commands.values()):
            command.on_notice(text)
        time.sleep(0.3)  # let the IOPub thread deliver the notice
        runtime.close()
    os._exit(1)
