"""A ZeroMQ socket owned by one I/O thread, which other threads send through thread-safely.

ZeroMQ sockets must not be used from two threads at once, yet both ends of the control plane
need to send from one thread (the main thread running a cell) while another receives (to notice
an interrupt or a dead peer). The I/O thread owns the socket; senders sign and serialise their
message in their own thread (so a message too large fails there, with a clear error), append it
to an outbox and wake the I/O thread through an inproc pipe. The same class serves rank 0 (a
ROUTER) and followers (DEALERs).

Whatever arrives is untrusted until verified: a message that is malformed, oversized, unsigned or
badly signed is dropped and logged (kind, frame count and size only, never its bytes), at most a
few warnings per interval, and the I/O thread goes on.
"""

from __future__ import annotations

import collections
import logging
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


class Channel:
    """Signed send/receive on ``socket`` from a background thread, with a periodic tick."""

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
        self._outbox: collections.deque = collections.deque()
        self._wake_lock = threading.Lock()
        self._serialize_lock = threading.Lock()
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
        """Sign and queue a message for the I/O thread; safe from any thread.

        Raises :class:`MessageTooLarge` in the caller's thread when a frame is over the limit the
        peer enforces (it would drop the connection).
        """
        with self._serialize_lock:  # Session numbers its messages; keep the numbers unique
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
        self._outbox.append((msg_type, frames, ident))
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)

    def wait_sent(self, timeout_s: float = 0.05) -> None:
        """Block until the I/O thread has sent everything queued (or ``timeout_s`` passes).

        A caller that goes on to compute holds the GIL, which would keep the I/O thread from
        sending for up to a switch interval; rank 0 waits here so the followers start first.
        """
        with self._sent:
            self._sent.wait_for(lambda: not self._outbox, timeout_s)

    def close(self, linger_s: float = 1.0) -> None:
        """Send what is queued (up to ``linger_s``), stop the thread and close the sockets."""
        self._closing.set()
        with self._wake_lock:
            self._wake_send.send(b"", zmq.NOBLOCK)
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(linger_s + 1.0)
        self.socket.close(linger=int(linger_s * 1000))
        self._wake_send.close(linger=0)
        self._wake_recv.close(linger=0)

    def _run(self) -> None:
        poller = zmq.Poller()
        poller.register(self.socket, zmq.POLLIN)
        poller.register(self._wake_recv, zmq.POLLIN)
        next_tick = time.monotonic()
        while True:
            events = dict(poller.poll(timeout=max(0.0, next_tick - time.monotonic()) * 1000))
            if self._wake_recv in events:
                self._drain_wakeups()
            self._flush_outbox()
            if self._closing.is_set():
                return
            if self.socket in events:
                self._receive_all()
            now = time.monotonic()
            self.dropped.flush(now)
            if now >= next_tick:
                next_tick = now + self._tick_s
                self._tick(now)

    def _drain_wakeups(self) -> None:
        while self._wake_recv.poll(0):
            self._wake_recv.recv()

    def _flush_outbox(self) -> None:
        while self._outbox:
            msg_type, frames, ident = self._outbox[0]
            try:
                self.socket.send_multipart(frames)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH and self._on_unreachable and ident is not None:
                    self._on_unreachable(ident)
                else:
                    log.warning("control plane: could not send %s: %s", msg_type, e)
            self._outbox.popleft()
        with self._sent:
            self._sent.notify_all()

    def _receive_all(self) -> None:
        """Receive what is waiting, at most a batch: a flood must not keep sends and ticks from running."""
        for _ in range(RECEIVE_BATCH):
            if not self.socket.poll(0):
                return
            try:
                frames = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            parsed = self._parse(frames)
            if parsed is not None:
                self._dispatch(*parsed)

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
