"""Liveness that needs no free interpreter: an echo device on every rank, and pingers that time it.

As in ipykernel's heartbeat, a ZeroMQ device in a thread of its own sends back whatever it gets.
The device loops inside libzmq with the GIL released, so it keeps answering while Python code
holds the GIL for minutes (a C extension, a tokenizer, a regex on a large text). A peer whose
echo is silent is stopped (SIGSTOP), frozen, or its node is unreachable; a peer whose process is
gone is told apart by its pid or its closed connection, not by silence.

Rank 0 binds an echo socket (followers ping it) and a ping socket (followers' echo devices
connect to it), and publishes both in the torch.distributed store next to the control endpoint.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import zmq

ECHO_KEY = "shardbook/echo"  # store key: rank 0's echo device, which followers ping
PINGER_KEY = "shardbook/pinger"  # store key: rank 0's pinger, which followers' echo devices connect to
PING = b"ping"
PING_S = 0.5
STALL_S = 2.0
"""A pinger whose own ticks stopped for this long was held up itself (its GIL, SIGSTOP): it restarts its clocks."""
MAX_PING_BYTES = 64
READ_BATCH = 256


def heartbeat_socket(kind: int) -> zmq.Socket:
    """A socket for pings and echoes only: tiny frames, nothing kept at close."""
    sock = zmq.Context.instance().socket(kind)
    sock.setsockopt(zmq.MAXMSGSIZE, MAX_PING_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 100)
    return sock


class Echo:
    """Sends every message back to its sender, from a ZeroMQ device running without the GIL.

    ``socket`` is a bound ROUTER (rank 0: replies are routed by the sender's identity) or a
    connected DEALER (followers: replies go back to the one peer).
    """

    def __init__(self, socket: zmq.Socket, name: str = "shardbook-echo"):
        self.socket = socket
        address = f"inproc://{name}-{id(self)}"
        self._control = socket.context.socket(zmq.PAIR)
        self._control.bind(address)
        self._device_end = socket.context.socket(zmq.PAIR)
        self._device_end.connect(address)
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Echo:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            zmq.proxy_steerable(self.socket, self.socket, None, self._device_end)
        except zmq.ContextTerminated:
            pass

    def close(self) -> None:
        self._control.send(b"TERMINATE")
        self._thread.join(1.0)
        for sock in (self.socket, self._device_end, self._control):
            sock.close(0)


class Pinger:
    """Pings peers' echo devices every :data:`PING_S` from its owner's I/O thread, and times their answers.

    A peer's silence is the age of its oldest unanswered ping. Answers are read before anything
    is judged, and a pinger that was itself held up (no tick for :data:`STALL_S`) restarts every
    clock, so only the peer's silence counts, never this process's own.
    """

    def __init__(self, socket: zmq.Socket):
        self.socket = socket
        self._routed = socket.type == zmq.ROUTER
        self._waiting: dict[bytes | None, float] = {}
        self._answered: set[bytes | None] = set()
        self.closed: set[bytes | None] = set()
        """Peers that answered once, then dropped their connection: their process is gone."""
        self._last_sent = float("-inf")
        self._last_tick: float | None = None

    def tick(self, now: float, peers: Iterable[bytes | None]) -> None:
        """Read answers, then ping ``peers`` (identities; None for a DEALER's one peer) if due."""
        self._read_answers()
        if self._last_tick is not None and now - self._last_tick > STALL_S:
            self._waiting = dict.fromkeys(self._waiting, now)
        self._last_tick = now
        if now - self._last_sent < PING_S:
            return
        self._last_sent = now
        for peer in peers:
            try:
                self.socket.send_multipart([peer, PING] if self._routed else [PING], zmq.NOBLOCK)
            except zmq.ZMQError as e:  # queue full, or (ROUTER_MANDATORY) no such peer
                if e.errno == zmq.EHOSTUNREACH and peer in self._answered:
                    self.closed.add(peer)
            self._waiting.setdefault(peer, now)

    def silence(self, peer: bytes | None, now: float) -> float:
        """Seconds since ``peer``'s oldest unanswered ping (0 when it answered them all)."""
        sent = self._waiting.get(peer)
        return 0.0 if sent is None else max(0.0, now - sent)

    def _read_answers(self) -> None:
        for _ in range(READ_BATCH):  # bounded: a flood on rank 0's ping socket must not hold its I/O thread
            if not self.socket.poll(0):
                return
            frames = self.socket.recv_multipart(zmq.NOBLOCK)
            peer = frames[0] if self._routed else None
            self._waiting.pop(peer, None)
            self._answered.add(peer)

    def close(self) -> None:
        self.socket.close(0)
