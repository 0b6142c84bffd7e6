"""Control-plane messages: a round trip between real sockets, and forged messages dropped."""

from __future__ import annotations

import logging
import threading

import pytest
import zmq

from shardbook.rankd import protocol
from shardbook.rankd.channel import Channel


class Endpoint:
    """A ROUTER channel (rank 0's side) collecting what it receives."""

    def __init__(self, key: bytes):
        self.received: list[tuple[protocol.Message, bytes]] = []
        self.got = threading.Event()
        sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.port = sock.bind_to_random_port("tcp://127.0.0.1")
        self.channel = Channel(sock, protocol.make_session(key), self.on_message, name="test-router").start()

    def on_message(self, message, ident):
        self.received.append((message, ident))
        self.got.set()


def dealer(port: int, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.connect(f"tcp://127.0.0.1:{port}")
    return sock


@pytest.fixture
def router():
    endpoint = Endpoint(b"secret")
    yield endpoint
    endpoint.channel.close(0)


def test_round_trip(router):
    sock = dealer(router.port, b"rank-1")
    session = protocol.make_session(b"secret")
    payload = {"name": "stdout", "text": "héllo ✓"}
    session.send(sock, protocol.STREAM, protocol.envelope(payload, id="c1", rank=1))
    assert router.got.wait(5)
    message, ident = router.received[0]
    assert (message.type, message.id, message.rank, message.payload, ident) == (protocol.STREAM, "c1", 1, payload, b"rank-1")
    sock.close(0)


def test_router_to_dealer(router):
    sock = dealer(router.port, b"rank-1")
    session = protocol.make_session(b"secret")
    session.send(sock, protocol.HELLO, protocol.envelope({}, rank=1))
    assert router.got.wait(5)
    router.channel.send(protocol.COMMAND, protocol.envelope({"kind": "exec", "args": {"code": "1"}}, id="c2"), ident=b"rank-1")
    assert sock.poll(5000)
    _, msg = session.recv(sock, mode=zmq.NOBLOCK)
    assert protocol.Message.from_session_msg(msg).payload["args"] == {"code": "1"}
    sock.close(0)


@pytest.mark.parametrize("forger_key", [b"wrong-key", None])
def test_forged_or_unsigned_message_is_dropped_and_logged(router, caplog, forger_key):
    sock = dealer(router.port, b"rank-1")
    if forger_key:
        forged = protocol.make_session(forger_key)
    else:
        from jupyter_client.session import Session

        forged = Session(key=b"", username="attacker")  # sends with an empty signature
    with caplog.at_level(logging.WARNING):
        forged.send(sock, protocol.COMMAND, protocol.envelope({"kind": "exec", "args": {"code": "import os"}}, rank=1))
        protocol.make_session(b"secret").send(sock, protocol.STREAM, protocol.envelope({"text": "genuine"}, rank=1))
        assert router.got.wait(5)
    assert [m.payload.get("text") for m, _ in router.received] == ["genuine"]
    assert "failed verification" in caplog.text
    sock.close(0)


def test_replayed_message_is_dropped(router, caplog):
    sock = dealer(router.port, b"rank-1")
    session = protocol.make_session(b"secret")
    msg = session.msg(protocol.STREAM, protocol.envelope({"text": "once"}, rank=1))
    frames = session.serialize(msg)
    with caplog.at_level(logging.WARNING):
        sock.send_multipart(frames)
        sock.send_multipart(frames)
        session.send(sock, protocol.STREAM, protocol.envelope({"text": "next"}, rank=1))
        deadline = threading.Event()
        for _ in range(50):
            if len(router.received) >= 2:
                break
            deadline.wait(0.05)
    assert [m.payload["text"] for m, _ in router.received] == ["once", "next"]
    assert "Duplicate Signature" in caplog.text


def test_other_protocol_version_is_refused():
    msg = {"header": {"msg_type": protocol.STREAM}, "content": {"v": 99, "payload": {}}}
    with pytest.raises(protocol.ProtocolError, match="same shardbook version"):
        protocol.Message.from_session_msg(msg)


def test_empty_key_is_refused():
    with pytest.raises(ValueError, match="HMAC key"):
        protocol.make_session(b"")
