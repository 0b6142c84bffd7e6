"""The process every rank of a shardbook kernel starts: rank 0 becomes the IPython kernel.

The kernelspec's argv is ``python -m torch.distributed.run ... -m shardbook.kernel -f CONN``;
every rank gets that argv, so this entry point splits them: rank 0 runs ipykernel's
``IPKernelApp`` with the shardbook magics loaded (the magics start the pool), every other rank
runs the follower loop and reads the same connection file for the control-plane key.
"""

from __future__ import annotations

import atexit
import errno
import json
import os
import socket
import sys
import time
from typing import NoReturn

from shardbook.rankd.control.lifetime import die_with_parent, exit_with_launcher
from shardbook.rankd.control.protocol import positive_number_env
from shardbook.rankd.control.startup_marks import mark, mark_process_start
from shardbook.rankd.control.world import JobShape

KERNEL_PORTS = ("shell_port", "iopub_port", "stdin_port", "control_port", "hb_port")
PORT_WAIT_S = positive_number_env("SHARDBOOK_PORT_WAIT", 30.0)
"""How long rank 0 waits for a port of its connection file that is still in use (a restart's old kernel ending)."""


def connection_file_from(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "-f" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--f=", "--IPKernelApp.connection_file=")):
            return arg.split("=", 1)[1]
    return None


def launch_kernel(argv: list[str]) -> None:
    """Rank 0: an ipykernel whose shell loads ``shardbook.magics`` (which connects the pool)."""
    from ipykernel.kernelapp import IPKernelApp

    mark("ipykernel imported")

    die_with_parent()
    exit_with_launcher()
    maybe_wait_for_ports(connection_file_from(argv))
    try:
        IPKernelApp.launch_instance(argv=[*argv, "--ext=shardbook.magics"])
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    exit_without_teardown()


def maybe_wait_for_ports(connection_file: str | None, timeout_s: float = PORT_WAIT_S) -> None:
    """Wait (under ``timeout_s``) until every TCP port of the connection file can be bound; nothing if all can.

    A restart reuses the connection file's ports (jupyter_client's default, and JupyterLab's), and
    the old kernel may still hold them: the old rank 0 ends on the launcher's SIGTERM, which takes
    its time on a busy machine (its exit handlers close the pool), while the new rank 0 is up in a
    second. ipykernel binds a fixed port once and dies of EADDRINUSE; waiting here, before it binds,
    lets the restart go through. A port still taken at the deadline is left to ipykernel's error.
    """
    try:
        with open(connection_file or "") as f:
            info = json.load(f)
    except (OSError, ValueError):  # no file yet: ipykernel picks the ports and writes it
        return
    if info.get("transport", "tcp") != "tcp":
        return
    host = {"*": "0.0.0.0", "": "127.0.0.1"}.get(info.get("ip", ""), info.get("ip", ""))
    deadline, said = time.monotonic() + timeout_s, False
    for name in KERNEL_PORTS:
        port = info.get(name)
        while isinstance(port, int) and port > 0 and port_in_use(host, port):
            if not said:
                said = True
                mark("kernel ports busy")
                log_to_stderr(
                    f"port {port} ({name}) of {connection_file} is still in use, probably by the kernel this one "
                    f"restarts, which is still ending; waiting up to {timeout_s:.0f} s (SHARDBOOK_PORT_WAIT)"
                )
            if time.monotonic() > deadline:
                log_to_stderr(
                    f"port {port} ({name}) is still in use after {timeout_s:.0f} s; the kernel cannot bind it"
                )
                return
            time.sleep(0.1)
    if said:
        mark("kernel ports free")


def port_in_use(host: str, port: int) -> bool:
    """True when another socket listens on ``host:port`` (bound as zmq binds: SO_REUSEADDR, so TIME_WAIT is free)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno == errno.EADDRINUSE
    return False


def log_to_stderr(text: str) -> None:
    """One line on the process's stderr: the Jupyter server's log (ipykernel has not replaced sys.stderr yet)."""
    print(f"[shardbook rank 0] {text}", file=sys.__stderr__, flush=True)


def exit_without_teardown() -> NoReturn:
    """End rank 0 after a clean kernel shutdown, skipping the interpreter's teardown.

    With torch and transformers imported, CPython's teardown (freeing every module and their
    objects) took 0.6-1.3 s here. torchrun needs about 1 s more after its last worker exits, and
    jupyter_client sends SIGTERM 2.5 s after its shutdown request: a kernel that took 2.5 s to end
    was killed, and torchrun logged the SIGTERM as a failure. The exit handlers (the pool, the
    connection file, IPython's history, logging) still run first; only the teardown is skipped.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # closed or replaced at shutdown
            pass
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mark_process_start()
    mark("python up")
    if JobShape.from_env().rank == 0:
        launch_kernel(argv)
        return 0
    from shardbook.rankd.__main__ import follower_main

    return follower_main(connection_file=connection_file_from(argv))
