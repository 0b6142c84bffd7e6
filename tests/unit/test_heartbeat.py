"""Heartbeats: echo devices answer without the GIL; a pinger counts only its peer's silence."""

from __future__ import annotations

import ctypes
import time

import zmq

from shardbook.rankd.control.heartbeat import STALL_S, Echo, Pinger, heartbeat_socket


def echo_and_pinger():
    """A follower-style echo (DEALER) connected to a rank-0-style pinger (ROUTER)."""
    router = heartbeat_socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = heartbeat_socket(zmq.DEALER)
    dealer.setsockopt(zmq.IDENTITY, b"rank-1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return Echo(dealer).start(), Pinger(router)


def first_answer(pinger: Pinger) -> None:
    deadline = time.monotonic() + 10
    answered = False
    while not answered and time.monotonic() < deadline:  # until the connection is up
        pinger.tick(time.monotonic(), [b"rank-1"])
        answered = pinger.socket.poll(50) != 0
    assert answered, "no echo within 10 s"
    pinger.tick(time.monotonic(), [])  # read that answer


def test_the_echo_answers_while_this_thread_holds_the_gil():
    echo, pinger = echo_and_pinger()
    try:
        first_answer(pinger)
        pinger.socket.send_multipart([b"rank-1", b"ping"])
        ctypes.PyDLL(None).usleep(300_000)  # holds the GIL: no Python thread runs, libzmq's device does
        assert pinger.socket.poll(0), "the echo device did not answer while the GIL was held"
    finally:
        echo.close()
        pinger.close()


def test_silence_counts_the_peer_not_a_stalled_pinger():
    router = heartbeat_socket(zmq.ROUTER)
    router.bind_to_random_port("tcp://127.0.0.1")
    pinger = Pinger(router)  # nobody answers
    try:
        pinger.tick(100.0, [b"rank-1"])
        pinger.tick(100.0 + STALL_S / 2, [b"rank-1"])
        assert pinger.silence(b"rank-1", 100.0 + STALL_S / 2) == STALL_S / 2
        pinger.tick(200.0, [b"rank-1"])  # this pinger did not run for 100 s: its own stall is no one's silence
        assert pinger.silence(b"rank-1", 201.0) == 1.0
    finally:
        pinger.close()


def test_a_peer_that_drops_its_connection_is_closed_not_silent():
    echo, pinger = echo_and_pinger()
    try:
        first_answer(pinger)
        echo.close()  # its process ended: the connection goes with it
        deadline = time.monotonic() + 10
        while b"rank-1" not in pinger.closed and time.monotonic() < deadline:
            pinger._last_sent = float("-inf")  # ping at every tick
            pinger.tick(time.monotonic(), [b"rank-1"])
            time.sleep(0.05)
        assert b"rank-1" in pinger.closed
    finally:
        pinger.close()
