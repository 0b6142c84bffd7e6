"""Driving a kernel through jupyter_client as a frontend does, for tests and benchmarks."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Execution:
    """What one execute_request produced: the reply and every IOPub message of its cell, in order."""

    reply: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    reply_at: float = 0.0

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
    """Run ``code``; collect its IOPub messages until the kernel is idle again (deadline ``timeout``)."""
    msg_id = kc.execute(code)
    deadline = time.monotonic() + timeout
    messages: list[dict[str, Any]] = []
    reply = None
    reply_at = 0.0
    idle = False
    while not (idle and reply is not None):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError(f"no reply/idle within {timeout} s for {code[:60]!r}; got {[m['msg_type'] for m in messages]}")
        if reply is None:
            try:
                candidate = kc.get_shell_msg(timeout=0.01)
                if candidate["parent_header"].get("msg_id") == msg_id:
                    reply, reply_at = candidate, time.monotonic()
            except queue.Empty:
                pass
        try:
            msg = kc.get_iopub_msg(timeout=0.01 if reply is None else min(remaining, 0.5))
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        msg["received_at"] = time.monotonic()
        if on_message is not None:
            on_message(msg)
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            idle = True
        elif msg["msg_type"] != "status":
            messages.append(msg)
    return Execution(reply, messages, reply_at)


def interrupt_when(
    handle, code: str, seen: Callable[[dict[str, Any]], bool], *, wait_s: float = 60.0, timeout: float = 120.0
) -> tuple[Execution, float]:
    """Run ``code`` on ``handle`` (a started kernel with ``run`` and ``km``) and interrupt the kernel at
    the first IOPub message ``seen`` accepts; returns the Execution and the seconds from the
    interrupt to its reply. Fails if that moment does not come within ``wait_s``."""
    result: dict[str, Any] = {}
    spotted = threading.Event()

    def on_message(msg: dict[str, Any]) -> None:
        if seen(msg):
            spotted.set()

    thread = threading.Thread(target=lambda: result.update(ex=handle.run(code, timeout=timeout, on_message=on_message)))
    thread.start()
    try:
        assert spotted.wait(wait_s), f"the moment to interrupt {code[:50]!r} never came"
        interrupted_at = time.monotonic()
        handle.km.interrupt_kernel()
        thread.join(timeout)
        return result["ex"], time.monotonic() - interrupted_at
    finally:
        if thread.is_alive():
            handle.km.interrupt_kernel()
            thread.join(timeout)
