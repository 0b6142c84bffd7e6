"""Control-plane messages: a round trip between real sockets, and forged messages dropped."""

from __future__ import annotations

import json
import logging
import random
import signal
import threading

import pytest
import zmq

from shardbook.rankd.control import protocol
from shardbook.rankd.control.channel import (
    DEFERRED_SIGNALS,
    Channel,
    DeferredInterrupts,
    MessageTooLarge,
    control_socket,
)


class Endpoint:
    """A ROUTER channel (rank 0's side) collecting what it receives."""

    def __init__(self, key: bytes):
        self.received: list[tuple[protocol.Message, bytes]] = []
        self.got = threading.Event()
        sock = control_socket(zmq.ROUTER)
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
    assert (message.type, message.id, message.rank, message.payload, ident) == (
        protocol.STREAM,
        "c1",
        1,
        payload,
        b"rank-1",
    )
    sock.close(0)


def test_router_to_dealer(router):
    sock = dealer(router.port, b"rank-1")
    session = protocol.make_session(b"secret")
    session.send(sock, protocol.HELLO, protocol.envelope({}, rank=1))
    assert router.got.wait(5)
    router.channel.send(
        protocol.COMMAND, protocol.envelope({"kind": "exec", "args": {"code": "1"}}, id="c2"), ident=b"rank-1"
    )
    assert sock.poll(5000)
    _, msg = session.recv(sock, mode=zmq.NOBLOCK)
    assert protocol.Message.from_session_msg(msg).payload["args"] == {"code": "1"}
    sock.close(0)


def test_a_send_goes_out_from_its_own_thread_while_the_io_thread_is_busy():
    """No hop through the I/O thread: a command is on the wire while that thread is still held up in a handler."""
    session = protocol.make_session(b"secret")
    entered, release = threading.Event(), threading.Event()

    def on_message(message, ident):
        entered.set()
        release.wait(10)

    sock = control_socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(sock, session, on_message, name="test-busy").start()
    follower = dealer(port, b"rank-1")
    try:
        session.send(follower, protocol.HELLO, protocol.envelope({}, rank=1))
        assert entered.wait(5)
        channel.send(protocol.COMMAND, protocol.envelope({"kind": "exec", "args": {"code": "pass"}}), ident=b"rank-1")
        assert follower.poll(2000), "the command waited for the I/O thread"
        assert not release.is_set()
    finally:
        release.set()
        follower.close(0)
        channel.close(0)


def test_sends_that_find_the_peer_queue_full_wait_and_keep_their_order():
    """A peer that does not read fills its queue: later messages wait in the outbox and all arrive, in order."""
    session = protocol.make_session(b"secret")
    sock = control_socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.SNDHWM, 1)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    hello = threading.Event()
    channel = Channel(sock, session, lambda message, ident: hello.set(), name="test-full").start()
    follower = dealer(port, b"rank-1")
    follower.setsockopt(zmq.RCVHWM, 1)
    try:
        session.send(follower, protocol.HELLO, protocol.envelope({}, rank=1))
        assert hello.wait(5)
        for i in range(60):  # 60 x 256 KiB: more than the socket buffers hold
            channel.send(protocol.STREAM, protocol.envelope({"i": i, "text": "x" * (1 << 18)}), ident=b"rank-1")
        assert channel._outbox, "the peer's queue never filled: the test sends too little"
        got = []
        while len(got) < 60 and follower.poll(5000):
            _, msg = session.recv(follower, mode=zmq.NOBLOCK)
            got.append(protocol.Message.from_session_msg(msg).payload["i"])
        assert got == list(range(60))
    finally:
        follower.close(0)
        channel.close(0)


@pytest.mark.parametrize("signum", DEFERRED_SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_an_interrupt_signal_during_a_send_is_handled_when_the_send_is_over(signum):
    """The main thread's SIGINT or SIGUSR1 handler (KeyboardInterrupt, or an interrupt sent to the ranks) must
    not run in the middle of a multipart send, nor wait for the lock its own thread holds."""
    handled = []

    def handler(signum, frame):
        handled.append(signum)

    saved = signal.signal(signum, handler)
    try:
        with DeferredInterrupts():
            signal.raise_signal(signum)
            assert handled == []
        assert handled == [signum]
        assert signal.getsignal(signum) is handler
    finally:
        signal.signal(signum, saved)


def test_a_sigusr1_handler_that_sends_runs_after_the_main_threads_own_send(router):
    """`chat --slurm`'s Ctrl-C (SIGUSR1) stops the reply, and the stop sends an interrupt on the channel. Arriving
    while the main thread is inside `Channel.send`, that handler would wait for the lock its own thread holds:
    it must run once the send is over, and both messages go out in order."""
    follower = dealer(router.port, b"rank-1")
    session = protocol.make_session(b"secret")
    session.send(follower, protocol.HELLO, protocol.envelope({}, rank=1))
    assert router.got.wait(5)
    channel, lock_held_in_handler = router.channel, []

    def stop_the_reply(signum, frame):
        lock_held_in_handler.append(channel._lock.locked())
        if not channel._lock.locked():  # held: sending would deadlock this very thread
            channel.send(protocol.COMMAND, protocol.envelope({"kind": "interrupt"}), ident=b"rank-1")

    serialize = channel._serialize

    def serialize_then_press(*args):
        channel._serialize = serialize
        signal.raise_signal(signal.SIGUSR1)  # the press lands inside the (first) send, under the lock
        return serialize(*args)

    saved = signal.signal(signal.SIGUSR1, stop_the_reply)
    channel._serialize = serialize_then_press
    try:
        channel.send(protocol.COMMAND, protocol.envelope({"kind": "exec", "args": {"code": "pass"}}), ident=b"rank-1")
    finally:
        channel._serialize = serialize
        signal.signal(signal.SIGUSR1, saved)
    assert lock_held_in_handler == [False], "the handler ran inside the send"
    kinds = []
    while len(kinds) < 2 and follower.poll(5000):
        _, msg = session.recv(follower, mode=zmq.NOBLOCK)
        kinds.append(protocol.Message.from_session_msg(msg).payload["kind"])
    assert kinds == ["exec", "interrupt"]
    follower.close(0)


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
    assert "duplicate signature" in caplog.text


def signed(session, header, parent=b"{}", metadata=b"{}", content=b"{}") -> list[bytes]:
    """Frames that pass the HMAC check but carry whatever the test wants."""
    parts = [header, parent, metadata, content]
    return [b"<IDS|MSG>", session.sign(parts), *parts]


def malformed_messages(session) -> list[list[bytes]]:
    """Hostile multipart messages: hand-picked shapes, validly signed nonsense, then random frames."""
    header = json.dumps(
        {"msg_id": "m", "msg_type": "stream", "username": "x", "session": "s", "date": "", "version": "5.3"}
    ).encode()

    def envelope(**kw):
        return json.dumps({"v": 1, "id": "c", "rank": 1, "payload": {}, **kw}).encode()

    shapes = [
        [b"<IDS|MSG>"],  # the Jupyter delimiter alone
        [b"no delimiter"],
        [b"<IDS|MSG>", b"sig"],
        [b"<IDS|MSG>", b"", b"{}", b"{}", b"{}", b"{}"],
        [b"<IDS|MSG>", b"PAYLOAD" * 1000, b"{}", b"{}", b"{}", b"{}"],
        [b"<IDS|MSG>"] * 7,
        signed(session, b"[1, 2]"),
        signed(session, b"{}"),
        signed(session, b"\xff\xfe"),
        signed(session, header, content=b"[1, 2]"),
        signed(session, header, content=b"not json"),
        signed(session, header, content=envelope(rank="one")),
        signed(session, header, content=envelope(payload=[1])),
        signed(session, header, content=envelope(id=7)),
        signed(session, header, content=envelope(v="PAYLOAD" * 100)),
        signed(session, header, content=b'{"v": 1, "payload": "PAYLOAD"}'),
    ]
    rng = random.Random(11)
    pieces = [b"<IDS|MSG>", b"{}", b"[]", b"PAYLOAD", b"", b"\x00" * 5]
    fuzz = [
        [
            rng.choice(pieces) if rng.random() < 0.5 else rng.randbytes(rng.randrange(0, 64))
            for _ in range(rng.randrange(1, 9))
        ]
        for _ in range(400)
    ]
    return shapes + fuzz


def test_malformed_messages_are_dropped_and_the_channel_lives_on(router, caplog):
    """Fuzz the I/O thread: nothing malformed may kill it, and its warnings are few and never quote the bytes."""
    session = protocol.make_session(b"secret")
    attacker = dealer(router.port, b"rank-1")
    with caplog.at_level(logging.WARNING):
        for frames in malformed_messages(session):
            attacker.send_multipart(frames)
        session.send(attacker, protocol.STREAM, protocol.envelope({"text": "still here"}, rank=1))
        assert router.got.wait(10), "the channel stopped receiving after malformed messages"
    assert [m.payload.get("text") for m, _ in router.received] == ["still here"]
    warnings = [r.getMessage() for r in caplog.records if r.name == "shardbook.rankd.control.channel"]
    assert 1 <= len(warnings) <= 6, warnings  # rate-limited: a burst, then a count at the next window
    assert not any("PAYLOAD" in w or "\\x" in w for w in warnings), warnings
    attacker.close(0)


def test_oversized_frames_are_refused_on_both_sides(monkeypatch):
    """The socket's limit (ZMQ_MAXMSGSIZE) refuses big frames; a sender learns of its own at once."""
    from shardbook.rankd.control import channel as channel_module

    monkeypatch.setattr(channel_module, "MAX_MESSAGE_BYTES", 1 << 16)
    endpoint = Endpoint(b"secret")
    try:
        session = protocol.make_session(b"secret")
        attacker = dealer(endpoint.port, b"rank-2")
        attacker.send_multipart([b"<IDS|MSG>", b"A" * (1 << 17), b"{}", b"{}", b"{}", b"{}"])
        genuine = dealer(endpoint.port, b"rank-1")
        session.send(genuine, protocol.STREAM, protocol.envelope({"text": "small"}, rank=1))
        assert endpoint.got.wait(5)
        assert [m.payload["text"] for m, _ in endpoint.received] == ["small"]
        with pytest.raises(MessageTooLarge, match="SHARDBOOK_MAX_MESSAGE_MB"):
            endpoint.channel.send(protocol.STREAM, protocol.envelope({"text": "x" * (1 << 17)}), ident=b"rank-1")
        attacker.close(0)
        genuine.close(0)
    finally:
        endpoint.channel.close(0)


def test_other_protocol_version_is_refused():
    msg = {"header": {"msg_type": protocol.STREAM}, "content": {"v": 99, "payload": {}}}
    with pytest.raises(protocol.ProtocolError, match="same shardbook version"):
        protocol.Message.from_session_msg(msg)


def test_empty_key_is_refused():
    with pytest.raises(ValueError, match="HMAC key"):
        protocol.make_session(b"")


def test_control_key_sources_in_order(tmp_path, monkeypatch):
    """One look-up for every rank and command: key file, then environment, then connection file, then session."""
    import types

    from shardbook.rankd.control.protocol import control_key

    for name in (protocol.KEY_ENV, protocol.KEY_FILE_ENV):
        monkeypatch.delenv(name, raising=False)
    key_file, connection = tmp_path / "job.key", tmp_path / "kernel.json"
    key_file.write_text("from-file\n")
    connection.write_text(json.dumps({"key": "from-connection", "signature_scheme": "hmac-sha512"}))
    session = types.SimpleNamespace(key=b"from-session", signature_scheme="hmac-sha384")
    assert control_key() is None
    assert control_key(session=session) == (b"from-session", "hmac-sha384")
    assert control_key(connection_file=connection, session=session) == (b"from-connection", "hmac-sha512")
    monkeypatch.setenv(protocol.KEY_ENV, "from-env")
    assert control_key(connection_file=connection, session=session) == (b"from-env", "hmac-sha256")
    assert control_key(key_file=key_file, connection_file=connection) == (b"from-file", "hmac-sha256")


@pytest.mark.parametrize("text", ["-1", "0", "nan", "inf", "ten"])
def test_settings_from_the_environment_must_be_positive(monkeypatch, caplog, text):
    monkeypatch.setenv("SHARDBOOK_TEST_SECONDS", text)
    with caplog.at_level(logging.WARNING):
        assert protocol.positive_number_env("SHARDBOOK_TEST_SECONDS", 60.0) == 60.0
    assert "SHARDBOOK_TEST_SECONDS" in caplog.text and "not a positive number" in caplog.text
