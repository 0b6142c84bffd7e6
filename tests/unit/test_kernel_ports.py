"""Rank 0 waits for the ports of its connection file that a restart's old kernel still holds."""

from __future__ import annotations

import json
import socket
import threading
import time

import zmq

from shardbook.kernel import app


def connection_file(tmp_path, **ports: int) -> str:
    path = tmp_path / "kernel.json"
    path.write_text(json.dumps({"transport": "tcp", "ip": "127.0.0.1", **ports}))
    return str(path)


def test_a_listening_port_is_in_use_and_a_closed_one_is_not():
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    assert app.port_in_use("127.0.0.1", port)
    client = socket.create_connection(("127.0.0.1", port))  # a connection left in TIME_WAIT does not count
    sock.close(linger=0)  # zmq's I/O thread closes the listener a moment later
    client.close()
    deadline = time.monotonic() + 10
    while app.port_in_use("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not app.port_in_use("127.0.0.1", port)


def test_the_wait_ends_when_the_old_kernel_releases_its_port(tmp_path, capfd):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    released = threading.Event()

    def release():
        sock.close(linger=0)
        released.set()

    threading.Timer(0.5, release).start()
    app.maybe_wait_for_ports(connection_file(tmp_path, shell_port=port, hb_port=0), timeout_s=60)
    assert released.is_set() and not app.port_in_use("127.0.0.1", port)
    err = capfd.readouterr().err
    assert f"port {port} (shell_port)" in err and "SHARDBOOK_PORT_WAIT" in err


def test_a_port_still_taken_at_the_deadline_is_left_to_ipykernel(tmp_path, capfd):
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    try:
        app.maybe_wait_for_ports(connection_file(tmp_path, iopub_port=port), timeout_s=0.3)
    finally:
        sock.close(linger=0)
    assert "still in use after 0 s" in capfd.readouterr().err


def test_free_ports_or_no_file_mean_no_wait(tmp_path, capfd):
    app.maybe_wait_for_ports(None)
    app.maybe_wait_for_ports(str(tmp_path / "missing.json"))
    app.maybe_wait_for_ports(connection_file(tmp_path, shell_port=0))
    assert capfd.readouterr().err == ""
