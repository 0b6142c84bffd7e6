"""Driving a kernel through jupyter_client as a frontend does, for tests and benchmarks."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import zmq


@dataclass
class Execution:
    """What one execute_request produced: the reply and every IOPub message of its cell, in order.

    Times are `time.perf_counter()` readings (CLOCK_MONOTONIC): `sent_at` just before the request
    went out, `idle_at` when the cell's idle status arrived, `reply_at` when its reply did; each
    message's `received_at` is when it arrived.
    """

    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    sent_at: float = 0.0
    idle_at: float = 0.0
    reply_at: float = 0.0

    @property
    def seconds(self) -> float:
        """The cell's round trip as a frontend sees it: request sent to the kernel idle again."""
        return self.idle_at - self.sent_at

    @property
    def status(self) -> str:
        return self.reply["content"]["status"]

    def of_type(self, *types: str) -> list[dict[str, Any]]:
        return [m for m in self.messages if m["msg_type"] in types]

    def stdout(self) -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream") if m["content"]["name"] == "stdout")

    def stderr(self) -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream") if m["content"]["name"] == "stderr")

    def text(self) -> str:
        return "".join(m["content"]["text"] for m in self.of_type("stream"))

    def error(self) -> dict[str, Any] | None:
        errors = self.of_type("error")
        return errors[-1]["content"] if errors else None

    def error_text(self) -> str:
        error = self.error()
        return "" if error is None else "\n".join([error["ename"], error["evalue"], *error["traceback"]])


def execute(kc, code: str, timeout: float = 60.0, on_message=None) -> Execution:
    """Run ``code``; collect its IOPub messages until the kernel is idle again and its reply (deadline ``timeout``).

    Both channels are watched by one poller, so every message is stamped as it arrives (the
    benchmarks time round trips of a few milliseconds with this); ``on_message`` sees each IOPub
    message of the cell as it comes.
    """
    iopub, shell = kc.iopub_channel, kc.shell_channel
    poller = zmq.Poller()
    for channel in (iopub, shell):
        poller.register(channel.socket, zmq.POLLIN)
    sent_at = time.perf_counter()
    msg_id = kc.execute(code)
    result = Execution(reply={}, sent_at=sent_at)
    deadline = sent_at + timeout
    while not (result.idle_at and result.reply):
        remaining = deadline - time.perf_counter()
        if remaining <= 0:
            raise TimeoutError(
                f"no reply/idle within {timeout} s for {code[:60]!r}; got {[m['msg_type'] for m in result.messages]}"
            )
        poller.poll(remaining * 1000)
        while shell.msg_ready():
            candidate = shell.get_msg(timeout=0)
            if candidate["parent_header"].get("msg_id") == msg_id:
                result.reply, result.reply_at = candidate, time.perf_counter()
        while iopub.msg_ready():
            _take_iopub(iopub.get_msg(timeout=0), msg_id, result, on_message)
    return result


def _take_iopub(msg: dict[str, Any], msg_id: str, result: Execution, on_message) -> None:
    if msg["parent_header"].get("msg_id") != msg_id:
        return
    msg["received_at"] = time.perf_counter()
    if on_message is not None:
        on_message(msg)
    if msg["msg_type"] == "status":
        if msg["content"]["execution_state"] == "idle":
            result.idle_at = msg["received_at"]
    else:
        result.messages.append(msg)


def interrupt_when(
    handle,
    code: str,
    seen: Callable[[dict[str, Any]], bool],
    *,
    wait_s: float = 60.0,
    timeout: float = 120.0,
    times: int = 1,
    every_s: float | Callable[[], float] = 0.0,
) -> tuple[Execution, float]:
    """Run ``code`` on ``handle`` (a started kernel with ``run`` and ``km``) and interrupt the kernel at
    the first IOPub message ``seen`` accepts (``times`` interrupts, ``every_s`` apart, or as far apart
    as each call of ``every_s`` says, as a person pressing the stop button again and again); returns the
    Execution and the seconds from the first interrupt to its reply. Fails if that moment does not
    come within ``wait_s``."""
    result: dict[str, Any] = {}
    spotted = threading.Event()

    def on_message(msg: dict[str, Any]) -> None:
        if seen(msg):
            spotted.set()

    def run() -> None:
        try:
            result["ex"] = handle.run(code, timeout=timeout, on_message=on_message)
        except Exception as e:  # raised in the test's thread below
            result["error"] = e

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert spotted.wait(wait_s), f"the moment to interrupt {code[:50]!r} never came"
        interrupted_at = time.monotonic()
        for i in range(times):
            if i:
                time.sleep(every_s() if callable(every_s) else every_s)
            handle.km.interrupt_kernel()
        thread.join(timeout)
        seconds = time.monotonic() - interrupted_at
        if handle.km.kernel_spec.interrupt_mode == "message":  # a late one must not hit the next cell
            wait_for_interrupt_replies(handle.km, times, deadline=time.monotonic() + timeout)
        if "error" in result:
            raise result["error"]
        assert "ex" in result, f"{code[:50]!r} did not end within {timeout} s of the interrupt"
        return result["ex"], seconds
    finally:
        if thread.is_alive():
            handle.km.interrupt_kernel()
            thread.join(timeout)


def wait_for_interrupt_replies(km, count: int, deadline: float) -> None:
    """Read ``count`` interrupt_reply messages from the manager's control socket:
    the kernel has then sent each SIGINT."""
    import zmq

    socket = km._control_socket
    while count:
        assert socket.poll(max(0.0, deadline - time.monotonic()) * 1000, zmq.POLLIN), (
            f"{count} interrupt replies never came"
        )
        _, msg = km.session.recv(socket)
        if msg is not None and msg["msg_type"] == "interrupt_reply":
            count -= 1
