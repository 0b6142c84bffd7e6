"""The follower loop every rank > 0 runs: wait on the control plane, run commands, report back.

Idle followers wait on ZeroMQ, never inside a collective (a person may think for an hour, and
NCCL/HCCL collectives time out). An echo device answers rank 0's heartbeats without the GIL (see
``heartbeat``). The channel's I/O thread sends the memory figures for ``%dist``, pings rank 0's
echo device, turns an ``interrupt`` into KeyboardInterrupt in the main thread, and ends the
process when rank 0 says shut down or its echo stays silent for ``SHARDBOOK_RANK0_TIMEOUT``.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import signal
import threading
import time
from datetime import timedelta
from typing import Any

import zmq

from shardbook.rankd.control import protocol, user_calls
from shardbook.rankd.control.capture import make_follower_shell
from shardbook.rankd.control.channel import Channel, control_socket
from shardbook.rankd.control.dispatch import STOPPED_BY_EVENT, RankContext, dispatch
from shardbook.rankd.control.heartbeat import ECHO_KEY, PINGER_KEY, Echo, Pinger, heartbeat_socket
from shardbook.rankd.control.startup_marks import mark
from shardbook.rankd.control.world import CONNECT_TIMEOUT_S, World, memory_in_use

log = logging.getLogger(__name__)

HEARTBEAT_S = 0.5
RANK0_SILENCE_S = protocol.positive_number_env("SHARDBOOK_RANK0_TIMEOUT", 60.0)
SHUTDOWN_GRACE_S = 1.0
EARLY_INTERRUPTS_KEPT = 16
"""Interrupts remembered for commands not yet started (an interrupt can overtake its command's start)."""


def rank0_endpoints(world: World, timeout_s: float = CONNECT_TIMEOUT_S) -> dict[str, str]:
    """Rank 0's control, echo and pinger endpoints, published in the torch.distributed store."""
    try:
        world.store.wait([protocol.CONTROL_KEY], timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {world.rank}: rank 0 did not publish its control endpoint within {timeout_s:.0f} s; "
            "is the kernel (python -m shardbook.kernel) running as rank 0 of this job?"
        ) from e
    return {key: world.store.get(key).decode() for key in (protocol.CONTROL_KEY, ECHO_KEY, PINGER_KEY)}


class Follower:
    """One follower rank: its channel to rank 0, its shell and its command loop."""

    def __init__(self, world: World, session: Any, endpoints: dict[str, str]):
        self.world = world
        self.ctx = RankContext(world=world, shell=None)  # made after the hello (see run)
        self.inbox: queue.Queue = queue.Queue()
        self.running_id: str | None = None
        self.running_kind: str | None = None
        self._early_interrupts: collections.deque[str] = collections.deque(maxlen=EARLY_INTERRUPTS_KEPT)
        self._lock = threading.Lock()
        self._last_heartbeat = 0.0
        self._main_thread = threading.main_thread().ident
        identity = f"rank-{world.rank}".encode()
        echo = heartbeat_socket(zmq.DEALER)
        echo.setsockopt(zmq.IDENTITY, identity)
        echo.connect(endpoints[PINGER_KEY])
        self._echo = Echo(echo, name=f"follower-{world.rank}-echo").start()
        pinger = heartbeat_socket(zmq.DEALER)
        pinger.connect(endpoints[ECHO_KEY])
        self._pinger = Pinger(pinger)
        socket = control_socket(zmq.DEALER)
        socket.setsockopt(zmq.IDENTITY, identity)
        socket.connect(endpoints[protocol.CONTROL_KEY])
        self.channel = Channel(socket, session, self._on_message, on_tick=self._on_tick, name=f"follower-{world.rank}")

    # --- I/O thread -------------------------------------------------------------------------
    def _on_message(self, message: protocol.Message, ident: bytes | None) -> None:
        if message.type == protocol.INTERRUPT:
            self._interrupt(message.id, calls_only=bool(message.payload.get("calls_only")))
        elif message.type == protocol.SHUTDOWN:
            self._shutdown("rank 0 asked to shut down")
        elif message.type == protocol.COMMAND:
            self.inbox.put(message)

    def _interrupt(self, command_id: str, calls_only: bool = False) -> None:
        with self._lock:
            if calls_only:  # the command goes on (the batch, for other rows): only its user functions stop
                if self.running_id == command_id:
                    user_calls.interrupt_calls()
                return
            if self.running_id != command_id:  # not started yet (still in the inbox), or already over
                self._early_interrupts.append(command_id)
                return
            self.ctx.stop_event.set()
            if self.running_kind not in STOPPED_BY_EVENT:
                signal.pthread_kill(self._main_thread, signal.SIGINT)
            else:  # a user function inside the command (an intervention) may never reach the next step
                user_calls.interrupt_calls()

    def _on_sigint(self, signum: int, frame: Any) -> None:
        """KeyboardInterrupt, except in a command stopped by its event outside a user function that was interrupted:
        a late SIGINT there would make this rank leave collectives the others still run."""
        if self.running_kind in STOPPED_BY_EVENT and not user_calls.main_call_interrupted():
            return
        raise KeyboardInterrupt

    def _on_tick(self, now: float) -> None:
        self.ctx.flush_if_due()
        if now - self._last_heartbeat >= HEARTBEAT_S:
            self._last_heartbeat = now
            payload = {"memory": memory_in_use(self.world.device), "running": user_calls.running()}
            self.send(protocol.HEARTBEAT, payload)
        self._pinger.tick(now, [None])
        silence = self._pinger.silence(None, now)
        if silence > RANK0_SILENCE_S:
            self._shutdown(
                f"rank 0 has not answered heartbeats for {silence:.0f} s (SHARDBOOK_RANK0_TIMEOUT): the kernel is "
                "gone or stopped, or its node is unreachable"
            )

    def _shutdown(self, why: str) -> None:
        """Leave now: the main thread may be stuck in a collective, so do not wait for it long."""
        log.info("rank %d exiting: %s", self.world.rank, why)
        self.inbox.put(None)
        deadline = time.monotonic() + SHUTDOWN_GRACE_S
        while self.inbox.qsize() and time.monotonic() < deadline:
            time.sleep(0.02)
        os._exit(0)

    # --- main thread ------------------------------------------------------------------------
    def send(self, msg_type: str, payload: dict[str, Any], command_id: str = "") -> None:
        self.channel.send(msg_type, protocol.envelope(payload, id=command_id, rank=self.world.rank))

    def run(self) -> None:
        signal.signal(signal.SIGINT, self._on_sigint)
        self.channel.start()
        self.send(protocol.HELLO, self.world.describe())
        mark("hello")
        # Rank 0 waits for every hello, then still starts its kernel before it can send a command: the
        # shell is made in that time, not before the hello.
        self.ctx.shell = make_follower_shell()
        while True:
            message = self._next_command()
            if message is None:
                return
            self._run_command(message)

    def _next_command(self) -> protocol.Message | None:
        while True:
            try:
                return self.inbox.get()
            except KeyboardInterrupt:  # an interrupt that arrived just after its command ended
                log.debug("rank %d: stray interrupt ignored while idle", self.world.rank)

    def _run_command(self, message: protocol.Message) -> None:
        def sink(msg_type: str, payload: dict[str, Any]) -> None:
            self.send(msg_type, payload, message.id)

        kind = message.payload.get("kind")
        with self._lock:
            self.running_id, self.running_kind = message.id, kind
            self.ctx.stop_event.clear()
            user_calls.begin_command()
            interrupted_early = message.id in self._early_interrupts
        try:
            if interrupted_early and kind not in STOPPED_BY_EVENT:
                raise KeyboardInterrupt  # interrupted before it started: it never runs
            if interrupted_early:
                self.ctx.stop_event.set()  # still run it: its collectives need this rank, which stops at a safe point
                user_calls.interrupt_calls()  # and the user functions it calls (interventions) do not run
            reply = dispatch(self.ctx, message.payload["kind"], message.payload.get("args", {}), sink)
        except KeyboardInterrupt:  # landed between the handler's end and the reply
            reply = {"status": "error", "error": {"ename": "KeyboardInterrupt", "evalue": "", "traceback": []}}
        finally:
            with self._lock:
                self.running_id = self.running_kind = None
        try:
            self.send(protocol.DONE, reply, message.id)
        except ValueError as e:  # too large (MessageTooLarge) or not encodable: the command must still end
            error = {"ename": type(e).__name__, "evalue": str(e), "traceback": []}
            self.send(protocol.DONE, {"status": "error", "error": error}, message.id)


def run_follower(world: World, session: Any) -> None:
    """Connect to rank 0 and serve commands until told to stop."""
    Follower(world, session, rank0_endpoints(world)).run()
