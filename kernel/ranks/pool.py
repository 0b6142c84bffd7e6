"""Rank 0's client of the control plane: the ``Pool`` of ranks a command runs on.

``Pool.run`` sends a command to the follower targets, runs rank 0's own part in-process through
the same handler table, streams every rank's output to a callback while it runs, and returns
each rank's reply. It never waits without a deadline on a rank that is dead, and turns an
interrupt (KeyboardInterrupt in rank 0) into an interrupt of every rank running the command.
"""

from __future__ import annotations

import logging
import math
import os
import signal
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq

from shardbook.kernel.ranks.liveness import SILENT_S, RankState, judge, ranks_health
from shardbook.rankd import commands  # noqa: F401  (fills the command table rank 0 dispatches from)
from shardbook.rankd.control import protocol, text, user_calls
from shardbook.rankd.control.channel import Channel, MessageTooLarge, control_socket, log_to_process_stderr
from shardbook.rankd.control.dispatch import STOPPED_BY_EVENT, RankContext, dispatch
from shardbook.rankd.control.heartbeat import ECHO_KEY, PINGER_KEY, Echo, Pinger, heartbeat_socket
from shardbook.rankd.control.world import CONNECT_TIMEOUT_S, World, memory_in_use

log = logging.getLogger(__name__)

INTERRUPT_GRACE_S = float(os.environ.get("SHARDBOOK_INTERRUPT_GRACE", "3"))
STRAGGLER_NOTICE_S = 3.0
STOPPED_FINISH_S = float(os.environ.get("SHARDBOOK_STOPPED_FINISH", "60"))
"""How long followers of a stopped command may take to reply once rank 0's part ended well (`_after_interrupt`)."""

OnOutput = Callable[[int, str, dict[str, Any]], None]
OnNotice = Callable[[str], None]


class PoolError(RuntimeError):
    """The pool cannot run a command (not connected, a rank dead or still busy)."""


def check_timeout(timeout_s: float | None) -> None:
    """A command's deadline is a positive, finite number of seconds, or None for no deadline."""
    if timeout_s is not None and not (math.isfinite(timeout_s) and timeout_s > 0):
        raise ValueError(
            f"a timeout of {timeout_s} s is not a deadline: give a positive number of seconds, "
            "or leave the timeout out for no limit"
        )


@dataclass
class Command:
    """One command in flight: its targets, the replies so far and who is told about output."""

    id: str
    kind: str
    targets: list[int]
    on_output: OnOutput
    on_notice: OnNotice
    started: float = field(default_factory=time.monotonic)
    replies: dict[int, dict[str, Any]] = field(default_factory=dict)
    done: threading.Event = field(default_factory=threading.Event)
    interrupted: bool = False
    sigint_forwarded: bool = False

    @property
    def pending(self) -> list[int]:
        return [r for r in self.targets if r not in self.replies]


@dataclass
class Outcome:
    """How a command ended on each target rank."""

    command: Command
    stuck: list[int]
    timed_out: bool = False

    @property
    def replies(self) -> dict[int, dict[str, Any]]:
        return self.command.replies

    @property
    def ok(self) -> bool:
        return not self.stuck and all(r.get("status") == "ok" for r in self.replies.values())


def control_host(world: World) -> tuple[str, str]:
    """(address to bind, address followers dial): loopback when the whole job is on this node."""
    if world.shape.single_node:
        return "127.0.0.1", "127.0.0.1"
    public = os.environ.get("SHARDBOOK_CONTROL_HOST")
    if not public and os.environ.get("GROUP_RANK", "0") == "0":
        public = os.environ.get("MASTER_ADDR")
    return "0.0.0.0", public or socket.gethostbyname(socket.gethostname())


class Pool:
    """Every rank of the job as seen from rank 0 (a world of one works the same, without sockets)."""

    def __init__(self, world: World, session: Any | None, ctx0: RankContext):
        self.world = world
        self.ctx0 = ctx0
        self.ranks = {r: RankState(rank=r) for r in range(world.world_size)}
        self.ranks[0] = RankState(rank=0, connected=True, local=True, **_static_facts(world))
        self.commands: dict[str, Command] = {}
        self.connected = threading.Event()
        self._lock = threading.RLock()
        self.channel: Channel | None = None
        self._echo: Echo | None = None
        self._pinger: Pinger | None = None
        if world.world_size == 1:
            self.connected.set()
        else:
            self._open(session)

    # --- start-up --------------------------------------------------------------------------
    def _open(self, session: Any) -> None:
        log_to_process_stderr(__name__)
        bind_host, public_host = control_host(self.world)
        sock = control_socket(zmq.ROUTER)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        port = sock.bind_to_random_port(f"tcp://{bind_host}")
        echo, pinger = heartbeat_socket(zmq.ROUTER), heartbeat_socket(zmq.ROUTER)
        pinger.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a follower that dropped its connection is gone
        for key, hb_sock in ((ECHO_KEY, echo), (PINGER_KEY, pinger)):
            self.world.store.set(key, f"tcp://{public_host}:{hb_sock.bind_to_random_port(f'tcp://{bind_host}')}")
        self._echo, self._pinger = Echo(echo, name="pool-echo").start(), Pinger(pinger)
        self.channel = Channel(
            sock, session, self._on_message, on_tick=self._on_tick, on_unreachable=self._on_unreachable, name="pool"
        ).start()
        self.world.store.set(protocol.CONTROL_KEY, f"tcp://{public_host}:{port}")  # last: followers wait for it

    def wait_connected(self, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
        """Block until every follower said hello, or raise naming the ranks still missing."""
        if self.connected.wait(timeout_s):
            return
        missing = [r for r, s in self.ranks.items() if not s.connected]
        raise PoolError(
            f"ranks {_ranks(missing)} did not connect to the kernel within {timeout_s:.0f} s. On other nodes, "
            "start them with `torchrun ... -m shardbook.rankd --key-file KEYFILE` (see the README); "
            "check their logs for errors, then restart the kernel."
        )

    # --- I/O thread ------------------------------------------------------------------------
    def _on_message(self, message: protocol.Message, ident: bytes | None) -> None:
        with self._lock:
            state = self.ranks.get(message.rank)
            if state is None or ident != f"rank-{message.rank}".encode():
                self.channel.dropped.drop("claimed to come from another rank")
                return
            if message.type == protocol.HELLO:
                self._on_hello(state, message.payload)
            elif message.type == protocol.HEARTBEAT:
                state.memory = message.payload.get("memory", {})
                state.running = message.payload.get("running", [])
            elif message.type == protocol.DONE:
                self._record_reply(message.id, message.rank, message.payload)
                return
        command = self.commands.get(message.id)
        if command is not None and message.type in protocol.OUTPUT_TYPES:
            command.on_output(message.rank, message.type, message.payload)

    def _on_hello(self, state: RankState, facts: dict[str, Any]) -> None:
        for key in ("host", "pid", "device", "backend", "slurm"):
            setattr(state, key, facts.get(key, getattr(state, key)))
        state.connected = True
        state.local = state.host == self.ranks[0].host
        if all(s.connected for s in self.ranks.values()):
            self.connected.set()

    def _record_reply(self, command_id: str, rank: int, reply: dict[str, Any]) -> None:
        command = self.commands.get(command_id)
        if command is None or rank in command.replies:
            return
        command.replies[rank] = reply
        if not command.pending:
            command.done.set()
            self.commands.pop(command_id, None)

    def _on_tick(self, now: float) -> None:
        self.ctx0.flush_if_due()
        self._pinger.tick(now, [f"rank-{r}".encode() for r in self._followers()])
        self._check_liveness(now)

    def _check_liveness(self, now: float) -> None:
        """Dead means gone (a local pid that exited) or silent past SHARDBOOK_HEARTBEAT_TIMEOUT;
        a GIL-bound rank answers."""
        with self._lock:
            for state in self.ranks.values():
                if state.rank == 0 or not state.connected or state.dead_reason:
                    continue
                ident = f"rank-{state.rank}".encode()
                dead, notice = judge(state, self._pinger.silence(ident, now), ident in self._pinger.closed)
                if dead:
                    self._mark_dead(state, dead)
                elif notice:
                    self._notify_waiting(state.rank, notice)

    def _notify_waiting(self, rank: int, text: str) -> None:
        for command in list(self.commands.values()):
            if rank in command.pending:
                command.on_notice(text)

    def _on_unreachable(self, ident: bytes) -> None:
        rank = int(ident.decode().split("-", 1)[1])
        with self._lock:
            if self.ranks[rank].connected and not self.ranks[rank].dead_reason:
                self._mark_dead(self.ranks[rank], "its control connection closed")

    def _mark_dead(self, state: RankState, reason: str) -> None:
        state.dead_reason = reason
        log.error("rank %d is dead: %s", state.rank, reason)
        for command in list(self.commands.values()):
            if state.rank in command.pending:
                error = {"ename": "RankDied", "evalue": f"rank {state.rank} died: {reason}", "traceback": []}
                self._record_reply(command.id, state.rank, {"status": "dead", "error": error})
                self._stop_own_part(command)

    def _stop_own_part(self, command: Command) -> None:
        """A rank died under a command: rank 0's part would wait for it in vain, so interrupt it."""
        if 0 in command.pending and command.sigint_forwarded:
            signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)

    # --- commands ----------------------------------------------------------------------------
    def run(
        self,
        kind: str,
        args: dict[str, Any],
        targets: list[int],
        on_output: OnOutput,
        on_notice: OnNotice,
        timeout_s: float | None = None,
        on_start: Callable[[Command], None] | None = None,
    ) -> Outcome:
        """Run a command on ``targets`` (rank 0 in-process) and wait for every reply.

        ``on_start`` gets the command once it is on its way to every rank, before rank 0 runs its
        part: from then on :meth:`interrupt` reaches every rank (a caller interrupting from
        another thread needs the command for that).
        """
        check_timeout(timeout_s)
        if not self.connected.is_set():
            self.wait_connected()
        command = Command(protocol.new_id(), kind, sorted(targets), on_output, on_notice)
        with self._lock:  # one step: a second caller at the same instant finds the targets busy
            self._refuse_dead_or_busy(command.targets)
            self.commands[command.id] = command
            self.ctx0.stop_event.clear()
            user_calls.begin_command()  # as the stop event: an interrupt of an earlier command no longer holds
        try:
            for rank in command.targets:
                if rank != 0:
                    self._send(rank, protocol.COMMAND, {"kind": kind, "args": args}, command.id)
        except MessageTooLarge as e:  # the same content for every rank: the first send fails, none went out
            with self._lock:
                self.commands.pop(command.id, None)
            raise PoolError(f"the {kind} command was not sent: {e}") from e
        if on_start is not None:
            on_start(command)
        with self._forward_interrupts(command):
            if 0 in command.targets:
                if self.channel is not None and len(command.targets) > 1:
                    self.channel.wait_sent()  # a command left waiting in the outbox: let the followers start first
                self._run_own_part(command, args)
            return self._wait(command, timeout_s)

    def check_can_run(self, targets: list[int]) -> None:
        """Raise `PoolError` if a target is dead or busy now (`run` checks again as it registers its command)."""
        if not self.connected.is_set():
            self.wait_connected()
        with self._lock:
            self._refuse_dead_or_busy(targets)

    def _refuse_dead_or_busy(self, targets: list[int]) -> None:
        """Raise `PoolError` if a target is dead or running a command; call with the lock held."""
        dead = [r for r in targets if self.ranks[r].dead_reason]
        busy = sorted({r for c in self.commands.values() for r in c.pending if r in targets})
        if dead:
            reasons = "; ".join(f"rank {r}: {self.ranks[r].dead_reason}" for r in dead)
            raise PoolError(f"ranks {_ranks(dead)} are dead ({reasons}). Restart the kernel to get a working pool.")
        if busy:
            raise PoolError(
                f"ranks {_ranks(busy)} are still busy with an earlier command (see %dist). They may be blocked in a "
                "collective that other ranks never joined: the process-group timeout "
                f"(SHARDBOOK_PG_TIMEOUT) will free them; interrupt again, or restart the kernel if they stay busy."
            )

    def _run_own_part(self, command: Command, args: dict[str, Any]) -> None:
        """Rank 0's part, its output and reply cleaned of text that is not Unicode as the followers' are by
        the control plane's packer (so rank 0 shows what the followers show, and IOPub never fails on it)."""

        def sink(msg_type: str, payload: dict[str, Any]) -> None:
            command.on_output(0, msg_type, text.clean(payload))

        reply = text.clean(dispatch(self.ctx0, command.kind, args, sink))
        with self._lock:
            self._record_reply(command.id, 0, reply)

    def _wait(self, command: Command, timeout_s: float | None) -> Outcome:
        deadline = None if timeout_s is None else command.started + timeout_s
        noticed = False
        while not command.done.is_set():
            try:
                if command.done.wait(0.05):
                    break
            except KeyboardInterrupt:
                command.interrupted = True
            if command.interrupted:
                return self._after_interrupt(command, timed_out=False)
            if deadline is not None and time.monotonic() > deadline:
                self.interrupt(command)
                return self._after_interrupt(command, timed_out=True)
            if not noticed:
                noticed = self._maybe_notice_stragglers(command)
        return Outcome(command, stuck=[])

    def _maybe_notice_stragglers(self, command: Command) -> bool:
        """If rank 0 already failed while others still run, say they may wait in a collective."""
        own = command.replies.get(0)
        if own is None or own.get("status") == "ok" or time.monotonic() - command.started < STRAGGLER_NOTICE_S:
            return False
        command.on_notice(
            f"rank 0 failed but ranks {_ranks(command.pending)} are still running. If the cell uses a "
            "collective that rank 0 never reached, they are waiting for it: interrupt (the stop button) to "
            "stop them; a rank inside a collective is freed only by the process-group timeout "
            f"({_pg_timeout_text()})."
        )
        return True

    def _after_interrupt(self, command: Command, timed_out: bool) -> Outcome:
        """Give interrupted ranks a short grace to report, then report the ones still stuck."""
        command.done.wait(INTERRUPT_GRACE_S)
        if not command.done.is_set() and command.kind in STOPPED_BY_EVENT and self._own_part_ok(command):
            # rank 0 stopped with the others, past their last collective together: the followers only finish
            # their step and reply, which with a slow step or a busy machine can take longer than the grace
            deadline = time.monotonic() + STOPPED_FINISH_S
            while not command.done.wait(0.05) and time.monotonic() < deadline:
                if any(self.ranks[r].dead_reason for r in command.pending):
                    break
        stuck = command.pending
        running = {r: self.ranks[r].running if r else user_calls.running() for r in stuck}
        if any(running.values()):
            where = "; ".join(f"rank {r} runs {', '.join(what)}" for r, what in running.items() if what)
            others = [r for r, what in running.items() if not what]
            command.on_notice(
                f"ranks {_ranks(stuck)} did not stop within {INTERRUPT_GRACE_S:.0f} s of the interrupt: {where}, "
                "a user function that did not return to Python when interrupted (a blocking call in C); "
                + (f"ranks {_ranks(others)} wait for it in a collective. " if others else "")
                + "They stop when it returns; interrupt again, or restart the kernel if it never does."
            )
        elif stuck:
            command.on_notice(
                f"ranks {_ranks(stuck)} did not stop within {INTERRUPT_GRACE_S:.0f} s of the interrupt: they are "
                "probably blocked inside a collective (all_reduce, barrier, ...) that other ranks never joined. "
                f"The process-group timeout ({_pg_timeout_text()}) will free them; %dist shows them busy until "
                "then, and cells that need them are refused. If they are still busy after that, restart the kernel."
            )
        return Outcome(command, stuck=stuck, timed_out=timed_out)

    def _own_part_ok(self, command: Command) -> bool:
        with self._lock:
            own = command.replies.get(0)
        return 0 in command.targets and own is not None and own.get("status") == "ok"

    def interrupt(self, command: Command) -> None:
        """Interrupt ``command`` on every rank still running it (rank 0's part through its stop event)."""
        command.interrupted = True
        if 0 in command.pending:
            self.ctx0.stop_event.set()
            user_calls.interrupt_calls(main_thread=False)  # one in the main thread gets the SIGINT (_SigintForwarder)
        for rank in command.pending:
            if rank != 0:
                self._send(rank, protocol.INTERRUPT, {}, command.id)

    def interrupt_user_calls(self, command: Command) -> None:
        """Interrupt the user functions (interventions) that ``command`` calls on every rank, not the command: the
        continuous batch goes on for other rows while one cell's rows, and the functions applied to them, stop."""
        if 0 in command.pending:
            user_calls.interrupt_calls(main_thread=False)
        for rank in command.pending:
            if rank != 0:
                self._send(rank, protocol.INTERRUPT, {"calls_only": True}, command.id)

    def _forward_interrupts(self, command: Command):
        return _SigintForwarder(self, command)

    # --- sending, status, shutdown -----------------------------------------------------------
    def _send(self, rank: int, msg_type: str, payload: dict[str, Any] | None = None, command_id: str = "") -> None:
        if self.channel is not None:
            self.channel.send(msg_type, protocol.envelope(payload, id=command_id), ident=f"rank-{rank}".encode())

    def _followers(self) -> list[int]:
        return [r for r, s in self.ranks.items() if r != 0 and s.connected and not s.dead_reason]

    def snapshot(self) -> list[dict[str, Any]]:
        """One row per rank for ``%dist``: host, pid, device, backend, state, memory."""
        self.ranks[0].memory = memory_in_use(self.world.device)
        with self._lock:
            busy = {r for c in self.commands.values() for r in c.pending}
            rows = []
            for r, s in sorted(self.ranks.items()):
                state = (
                    "dead" if s.dead_reason else "connecting" if not s.connected else "busy" if r in busy else "idle"
                )
                if state in ("busy", "idle") and s.silent_s > SILENT_S:
                    state += f", silent {s.silent_s:.0f} s"
                rows.append({**vars(s), "state": state})
        return rows

    def health(self) -> dict[str, Any]:
        """Each rank's state (idle, busy, silent, dead, connecting) and whether the ranks can serve, for ``/health``."""
        if self.world.world_size > 1 and self._pinger is not None:
            self._check_liveness(time.monotonic())
        with self._lock:
            busy = {r for c in self.commands.values() for r in c.pending}
            loading = any(c.kind == "load" and c.pending for c in self.commands.values())
            return ranks_health(list(self.ranks.values()), busy, loading)

    def dead_ranks(self) -> list[RankState]:
        """Ranks known dead, after a fresh look at the local pids."""
        self._check_liveness(time.monotonic())
        return [s for s in self.ranks.values() if s.dead_reason]

    def shutdown(self) -> None:
        """Tell every follower to exit and close the control plane."""
        if self.channel is None:
            return
        for rank in range(1, self.world.world_size):
            self._send(rank, protocol.SHUTDOWN)
        self.channel.close(linger_s=0.2)  # loopback or LAN: the shutdown goes out at once
        self.channel = None
        self._echo.close()
        self._pinger.close()


class _SigintForwarder:
    """While a command runs in the main thread, SIGINT also interrupts the followers."""

    def __init__(self, pool: Pool, command: Command):
        self.pool, self.command = pool, command
        self.saved = None

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            self.saved = signal.getsignal(signal.SIGINT)
            signal.signal(signal.SIGINT, self._handle)
            self.command.sigint_forwarded = True
        return self

    def _handle(self, signum, frame):
        self.pool.interrupt(self.command)
        if self.command.kind not in STOPPED_BY_EVENT or user_calls.claim_main_interrupt():
            raise KeyboardInterrupt  # the cell's code, or a user function inside the command (an intervention)

    def __exit__(self, *exc):
        self.command.sigint_forwarded = False
        if self.saved is not None:
            signal.signal(signal.SIGINT, self.saved)
        return False


def _static_facts(world: World) -> dict[str, Any]:
    facts = world.describe()
    facts.pop("rank")
    return facts


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in sorted(ranks))


def _pg_timeout_text() -> str:
    from shardbook.rankd.control.world import process_group_timeout

    seconds = process_group_timeout().total_seconds()
    return f"{seconds:.0f} s, set by SHARDBOOK_PG_TIMEOUT"
