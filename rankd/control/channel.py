"""A ZeroMQ socket that any thread sends on at once, and one I/O thread receives from.

ZeroMQ sockets must not be used from two threads at once, yet both ends of the control plane
send from one thread (the main thread running a cell) while another receives (to notice an
interrupt or a dead peer). Every use of the socket is therefore under one lock: a sender signs,
serialises and sends its message in its own thread (a message too large fails there, with a
clear error), with no hop to another thread; the I/O thread takes the lock only to receive, and
sleeps on the socket's file descriptor, never inside the socket. As that descriptor only
signals changes, whoever used the socket looks at its events afterwards and wakes the I/O thread
when a message waits. A message that cannot go out at once (the peer's queue is full) waits in
an outbox that the I/O thread sends in order. The same class serves rank 0 (a ROUTER) and
followers (DEALERs).

Whatever arrives is untrusted until verified: a message that is malformed, oversized, unsigned or
badly signed is dropped and logged (kind, frame count and size only, never its bytes), at most a
few warnings per interval, and the I/O thread goes on.
"""

from __future__ import annotations

import _signal
import collections
import logging
import signal
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from shardbook.rankd.control.protocol import Message, ProtocolError, positive_number_env, unsendable

log = logging.getLogger(__name__)

OnMessage = Callable[[Message, bytes | None], None]
MAX_MESSAGE_BYTES = int(positive_number_env("SHARDBOOK_MAX_MESSAGE_MB", 32) * (1 << 20))
"""Largest frame a control socket accepts (ZMQ_MAXMSGSIZE: a larger one disconnects its sender)."""


def log_to_process_stderr(*loggers: str) -> None:
    """Send these loggers to the process's own stderr (the Jupyter server's log), never into a cell.

    Without a handler, Python writes warnings to ``sys.stderr``, which a kernel captures into the
    running cell: a flood of bad messages would become a flood of cell output.
    """
    for name in (__name__, *loggers):
        logger = logging.getLogger(name)
        if not any(getattr(h, "shardbook_process_stderr", False) for h in logger.handlers):
            handler = logging.StreamHandler(sys.__stderr__)
            handler.shardbook_process_stderr = True
            handler.setFormatter(logging.Formatter("[shardbook] %(levelname)s %(name)s: %(message)s"))
            logger.addHandler(handler)
            logger.propagate = False


RECEIVE_BATCH = 256


class MessageTooLarge(ValueError):
    """A message over :data:`MAX_MESSAGE_BYTES`: refused before it is sent."""


def control_socket(kind: int) -> zmq.Socket:
    """A control-plane socket that refuses frames over :data:`MAX_MESSAGE_BYTES` (set before bind/connect)."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 1000)
    return sock


class DropLog:
    """Warnings about dropped messages, without their bytes: ``burst`` per ``window_s``, then a count."""

    def __init__(self, burst: int = 5, window_s: float = 10.0):
        self.burst, self.window_s = burst, window_s
        self._window_start = 0.0
        self._logged = 0
        self._suppressed = 0

    def drop(self, reason: str, frames: list[bytes] = ()) -> None:
        now = time.monotonic()
        self.flush(now)
        if self._logged < self.burst:
            self._logged += 1
            size = sum(len(f) for f in frames)
            log.warning("control plane: dropped a message that %s (%d frames, %d bytes)", reason, len(frames), size)
        else:
            self._suppressed += 1

    def flush(self, now: float) -> None:
        """Start a new window when the last one is over, reporting how many warnings it held back."""
        if now - self._window_start < self.window_s:
            return
        if self._suppressed:
            log.warning(
                "control plane: dropped %d more bad messages in the last %.0f s "
                "(warnings are limited to %d per %.0f s)",
                self._suppressed,
                now - self._window_start,
                self.burst,
                self.window_s,
            )
        self._window_start, self._logged, self._suppressed = now, 0, 0


def _verification_failure(error: Exception) -> str:
    """Our own words for why Session refused a message (its exception text quotes the message's bytes)."""
    text = str(error)
    for known in ("DELIM not in msg_list", "Unsigned Message", "Duplicate Signature", "Invalid Signature"):
        if text.startswith(known):
            return "has no message delimiter" if known.startswith("DELIM") else f"failed verification ({known.lower()})"
    return f"failed verification (malformed: {type(error).__name__})"


# The signals whose Python handler may raise KeyboardInterrupt or send an interrupt on a channel: SIGINT, and
# SIGUSR1 (the terminal chat's Ctrl-C under ``--slurm`` reaches rank 0 as SIGUSR1).
DEFERRED_SIGNALS = tuple(s for s in (signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None)


class DeferredInterrupts:
    """In the main thread, hold the interrupt signals' Python handlers back until the block ends, then run them.

    Such a handler raises KeyboardInterrupt (or sends an interrupt itself) wherever the main thread is;
    in the middle of a multipart send it would leave half a message on the socket, or wait forever
    for the lock its own thread holds. Other threads never run Python signal handlers. ``_signal``
    is ``signal`` without its enum conversions, which cost 29 us a send against 1.3 us.
    """

    def __enter__(self) -> DeferredInterrupts:
        self.saved: dict[int, Any] = {}
        self.caught: dict[int, Any] = {}
        if threading.get_ident() == threading.main_thread().ident:
            for signum in DEFERRED_SIGNALS:
                handler = _signal.getsignal(signum)  # None: installed outside Python, cannot be put back
                if handler is not None:
                    self.saved[signum] = handler
                    _signal.signal(signum, self._catch)
        return self

    def _catch(self, signum: int, frame: Any) -> None:
        self.caught.setdefault(signum, frame)

    def run_caught(self) -> None:
        """Run the handlers of the signals held so far, now, inside the block (later ones are held again).

        For a block that waits and can stop safely while it waits (a shared-memory sum waiting for a peer).
        """
        caught, self.caught = self.caught, {}
        for signum, frame in caught.items():
            handler = self.saved[signum]
            if callable(handler):
                handler(signum, frame)
            elif handler == signal.SIG_DFL:
                _signal.signal(signum, handler)
                signal.raise_signal(signum)

    def __exit__(self, *exc: object) -> None:
        for signum, handler in self.saved.items():
            _signal.signal(signum, handler)
        self.run_caught()


class Channel:
    """Signed messages over ``socket``: sent from any thread at once, received by a background thread with a tick."""

    def __init__(
        self,
        socket: zmq.Socket,
        session: Any,
        on_message: OnMessage,
        *,
        on_tick: Callable[[float], None] | None = None,
        tick_s: float = 0.05,
        on_unreachable: Callable[[bytes], None] | None = None,
        name: str = "shardbook-channel",
    ):
        self.socket = socket
        self.session = session
        self._on_message = on_message
        self._on_tick = on_tick
        self._on_unreachable = on_unreachable
        self._tick_s = tick_s
        self._lock = threading.Lock()  # every use of the socket, and Session's numbering of its messages
        self._outbox: collections.deque = collections.deque()
        self._unreachable: collections.deque[bytes] = collections.deque()
        self._wake_lock = threading.Lock()
        self.dropped = DropLog()
        ctx = socket.context
        address = f"inproc://{name}-{id(self)}"
        self._wake_recv = ctx.socket(zmq.PAIR)
        self._wake_recv.bind(address)
        self._wake_send = ctx.socket(zmq.PAIR)
        self._wake_send.connect(address)
        self._sent = threading.Condition()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Channel:
        self._thread.start()
        return self

    def send(self, msg_type: str, content: dict[str, Any], ident: bytes | None = None) -> None:
        """Sign and send a message from the calling thread; safe from any thread.

        Raises :class:`MessageTooLarge` when a frame is over the limit the peer enforces (it would
        drop the connection). A message that cannot go out at once waits in the outbox, in order.
        """
        with DeferredInterrupts(), self._lock:
            frames = self._serialize(msg_type, content, ident)
            queued = bool(self._outbox) or not self._send_now(msg_type, frames, ident)
            if queued:
                self._outbox.append((msg_type, frames, ident))
            wake = queued or bool(self._unreachable) or self._message_waiting()
        if wake:
            self._wake()

    def _serialize(self, msg_type: str, content: dict[str, Any], ident: bytes | None) -> list[bytes]:
        try:
            frames = self.session.serialize(self.session.msg(msg_type, content), ident)
        except (TypeError, ValueError) as e:  # content that is not JSON must not take the sender down
            log.warning("control plane: could not serialise a %s message: %s", msg_type, type(e).__name__)
            frames = self.session.serialize(self.session.msg(*unsendable(msg_type, content, e)), ident)
        largest = max(len(f) for f in frames)
        if largest > MAX_MESSAGE_BYTES:
            raise MessageTooLarge(
                f"a {msg_type} message of {largest / (1 << 20):.1f} MiB is over the control plane's limit of "
                f"{MAX_MESSAGE_BYTES / (1 << 20):.0f} MiB (SHARDBOOK_MAX_MESSAGE_MB): send less at once, or write "
                "large data to a file and pass its path"
            )
        return frames

    def _send_now(self, msg_type: str, frames: list[bytes], ident: bytes | None) -> bool:
        """Hand ``frames`` to ZeroMQ without blocking (the lock held); False when the peer's queue is full."""
        try:
            self.socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            return False
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH and self._on_unreachable and ident is not None:
                self._unreachable.append(ident)  # reported from the I/O thread, as everything it learns
            else:
                log.warning("control plane: could not send %s: %s", msg_type, e)
        return True

    def _message_waiting(self) -> bool:
        """Whether a message waits to be received (the lock held). Any use of the socket may have consumed
        the descriptor's signal the I/O thread sleeps on, so every user asks afterwards."""
        try:
            return bool(self.socket.getsockopt(zmq.EVENTS) & zmq.POLLIN)
        except zmq.ZMQError:  # closed
            return False

    def _wake(self) -> None:
        with self._wake_lock:
            try:
                self._wake_send.send(b"", zmq.NOBLOCK)
            except zmq.Again:  # a thousand wake-ups wait already
                pass

    def wait_sent(self, timeout_s: float = 0.05) -> None:
        """Block until the outbox is empty (or ``timeout_s`` passes); at once when every send went out directly.

        A caller that goes on to compute holds the GIL, which would keep the I/O thread from
        sending what waits for up to a switch interval; rank 0 waits here so the followers start first.
        """
        with self._sent:
            self._sent.wait_for(lambda: not self._outbox, timeout_s)

    def close(self, linger_s: float = 1.0) -> None:
        """Send what is queued (up to ``linger_s``), stop the thread and close the sockets."""
        self._closing.set()
        self._wake()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(linger_s + 1.0)
        with self._lock:
            self.socket.close(linger=int(linger_s * 1000))
        self._wake_send.close(linger=0)
        self._wake_recv.close(linger=0)

    def _run(self) -> None:
        with self._lock:
            descriptor = self.socket.getsockopt(zmq.FD)
        poller = zmq.Poller()
        poller.register(descriptor, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        next_tick = time.monotonic()
        while True:
            received, more = self._exchange()
            for frames in received:
                parsed = self._parse(frames)
                if parsed is not None:
                    self._dispatch(*parsed)
            while self._unreachable:
                self._on_unreachable(self._unreachable.popleft())
            if self._closing.is_set():
                return
            now = time.monotonic()
            self.dropped.flush(now)
            if now >= next_tick:
                next_tick = now + self._tick_s
                self._tick(now)
            if not more and self._wake_recv in dict(poller.poll(max(0.0, next_tick - time.monotonic()) * 1000)):
                self._drain_wakeups()

    def _exchange(self) -> tuple[list[list[bytes]], bool]:
        """Send what waits in the outbox, receive a batch, and say whether more is waiting, under the lock.

        At most a batch: a flood must not keep sends and ticks from running.
        """
        received = []
        with self._lock:
            self._flush_outbox()
            while len(received) < RECEIVE_BATCH:
                try:
                    received.append(self.socket.recv_multipart(zmq.NOBLOCK))
                except zmq.Again:
                    break
            events = self.socket.getsockopt(zmq.EVENTS)
        return received, bool(events & zmq.POLLIN or (self._outbox and events & zmq.POLLOUT))

    def _flush_outbox(self) -> None:
        while self._outbox:
            msg_type, frames, ident = self._outbox[0]
            if not self._send_now(msg_type, frames, ident):
                return  # the peer's queue is full: the rest waits until the socket is writable
            self._outbox.popleft()
        with self._sent:
            self._sent.notify_all()

    def _drain_wakeups(self) -> None:
        while self._wake_recv.poll(0):
            self._wake_recv.recv()

    def _parse(self, frames: list[bytes]) -> tuple[Message, bytes | None] | None:
        """The verified message in ``frames`` and its sender's identity, or None (dropped, logged)."""
        try:
            idents, msg_list = self.session.feed_identities(frames)
            raw = self.session.deserialize(msg_list)
            message = Message.from_session_msg(raw)
        except ProtocolError as e:
            self.dropped.drop(f"is not a shardbook message ({e})", frames)
        except Exception as e:  # Session raises ValueError, TypeError, KeyError... on hostile input
            self.dropped.drop(_verification_failure(e), frames)
        else:
            return message, idents[0] if idents else None
        return None

    def _dispatch(self, message: Message, ident: bytes | None) -> None:
        try:
            self._on_message(message, ident)
        except Exception:  # a bug in a handler must not kill the I/O thread
            log.exception("control plane: handler for %s failed", message.type)

    def _tick(self, now: float) -> None:
        if self._on_tick is None:
            return
        try:
            self._on_tick(now)
        except Exception:
            log.exception("control plane: tick failed")
