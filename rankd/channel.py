"""A ZeroMQ socket owned by one I/O thread, which other threads send through thread-safely.

ZeroMQ sockets must not be used from two threads at once, yet both ends of the control plane
need to send from one thread (the main thread running a cell) while another receives (to notice
an interrupt or a dead peer). The I/O thread owns the socket; senders append to an outbox and
wake it through an inproc pipe. The same class serves rank 0 (a ROUTER) and followers (DEALERs).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from typing import Any, Callable

import zmq

from .protocol import Message, ProtocolError

log = logging.getLogger(__name__)

OnMessage = Callable[[Message, bytes | None], None]


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
        ctx = socket.context
        address = f"inproc://{name}-{id(self)}"
        self._wake_recv = ctx.socket(zmq.PAIR)
        self._wake_recv.bind(address)
        self._wake_send = ctx.socket(zmq.PAIR)
        self._wake_send.connect(address)
        self._sent = threading.Condition()
        self._closing = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> "Channel":
        self._thread.start()
        return self

    def send(self, msg_type: str, content: dict[str, Any], ident: bytes | None = None) -> None:
        """Queue a message for the I/O thread; safe from any thread."""
        self._outbox.append((msg_type, content, ident))
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
            if now >= next_tick:
                next_tick = now + self._tick_s
                self._tick(now)

    def _drain_wakeups(self) -> None:
        while self._wake_recv.poll(0):
            self._wake_recv.recv()

    def _flush_outbox(self) -> None:
        while self._outbox:
            msg_type, content, ident = self._outbox[0]
            try:
                self.session.send(self.socket, msg_type, content, ident=ident)
            except zmq.ZMQError as e:
                if e.errno == zmq.EHOSTUNREACH and self._on_unreachable and ident is not None:
                    self._on_unreachable(ident)
                else:
                    log.warning("control plane: could not send %s: %s", msg_type, e)
            self._outbox.popleft()
        with self._sent:
            self._sent.notify_all()

    def _receive_all(self) -> None:
        while self.socket.poll(0):
            try:
                idents, raw = self.session.recv(self.socket, mode=zmq.NOBLOCK)
            except ValueError as e:  # bad or missing signature, or a malformed frame list
                log.warning("control plane: dropped a message that failed verification (%s)", e)
                continue
            if raw is None:
                return
            try:
                message = Message.from_session_msg(raw)
            except (ProtocolError, KeyError, TypeError) as e:
                log.warning("control plane: dropped a message: %s", e)
                continue
            self._dispatch(message, idents[0] if idents else None)

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
