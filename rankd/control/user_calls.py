"""User functions called from inside a command (interventions in a forward), and how an interrupt reaches them.

A command that every rank runs in step (a reply, a trace) is interrupted through its stop event,
never by KeyboardInterrupt, which would make the rank leave collectives the others still run. A
user's function called from inside such a command (an ``%intervene`` function) is another matter:
it may sleep or loop, and its rank then never reaches the next step where the stop event is
checked. So each such call is recorded here (:func:`user_call`), and :func:`interrupt_calls`
raises KeyboardInterrupt inside it: in the main thread by SIGINT, which also ends a ``time.sleep``
or a blocking wait; in another thread by an asynchronous exception
(``PyThreadState_SetAsyncExc``), which reaches Python code (a loop) but not a call blocked in C.
The caller catches it around the user's function alone, so the rank goes on with the forward and
stays in step with the others. An interrupt that comes before the function is called (the rank was
still in the forward, or in a collective, when the stop button was pressed) holds for the rest of
the command: a user function it calls from then on is interrupted as it starts, rather than
running (sleeping 30 s, looping forever) while the other ranks wait for this one.

Followers run ``model.generate`` in a worker thread; while their main thread only waits for it,
:func:`serve_calls` lets it run the user's functions instead (:func:`call`), where SIGINT reaches them.
"""

from __future__ import annotations

import contextlib
import ctypes
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Call:
    """One user function running now: what it is, in which thread, since when, and whether it was interrupted."""

    what: str
    thread: int
    started: float = field(default_factory=time.monotonic)
    interrupted: bool = False

    @property
    def in_main_thread(self) -> bool:
        return self.thread == threading.main_thread().ident

    def describe(self) -> str:
        return f"{self.what} (for {time.monotonic() - self.started:.1f} s)"


_lock = threading.Lock()
_calls: dict[int, Call] = {}
_interrupted = threading.Event()
"""The command running on this rank was interrupted: each user function it calls from then on is interrupted at once."""
_server: list[Callable[[Callable[[], None]], None]] = []


def running() -> list[str]:
    """What user functions run on this rank now, for rank 0's messages."""
    with _lock:
        return [c.describe() for c in _calls.values()]


def main_call_interrupted() -> bool:
    """Whether the main thread runs a user function that an interrupt is meant for (a SIGINT handler asks)."""
    with _lock:
        main = _calls.get(threading.main_thread().ident)
        return main is not None and main.interrupted


def claim_main_interrupt() -> bool:
    """Mark the main thread's user function interrupted, if one runs; whether one does (rank 0's SIGINT handler)."""
    with _lock:
        main = _calls.get(threading.main_thread().ident)
        if main is not None:
            main.interrupted = True
        return main is not None


def interrupted() -> bool:
    """Whether the command running on this rank was interrupted (a user's hook may check it, to stop early)."""
    return _interrupted.is_set()


def begin_command() -> None:
    """A command starts on this rank: an interrupt of the one before no longer holds (see :func:`interrupt_calls`)."""
    _interrupted.clear()


def interrupt_calls(*, main_thread: bool = True) -> list[str]:
    """Raise KeyboardInterrupt in every user function running on this rank, and in each one the command calls
    from now on (until :func:`begin_command`); what was interrupted.

    ``main_thread=False`` leaves a call in the main thread alone (its SIGINT is on its way anyway).
    """
    with _lock:
        _interrupted.set()
        hit = []
        for call in _calls.values():
            if call.in_main_thread:
                if not main_thread:
                    continue
                call.interrupted = True
                signal.pthread_kill(call.thread, signal.SIGINT)
            else:
                call.interrupted = True
                _raise_in(call.thread, KeyboardInterrupt)
            hit.append(call.describe())
        return hit


def _raise_in(ident: int, exc: type[BaseException] | None) -> None:
    """Raise ``exc`` in thread ``ident`` at its next Python instruction (None: cancel one still pending)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(ident), ctypes.py_object(exc) if exc else None)


@contextlib.contextmanager
def user_call(what: str) -> Iterator[Call]:
    """Record the user function run inside the block, so that an interrupt reaches it (see the module)."""
    ident = threading.get_ident()
    call = Call(what, ident)
    with _lock:
        if _interrupted.is_set():  # the stop button came before the function was called: it does not run
            raise KeyboardInterrupt
        _calls[ident] = call
    try:
        yield call
    finally:
        with _lock:
            _calls.pop(ident, None)
            if call.interrupted and not call.in_main_thread:
                _raise_in(ident, None)  # one still pending


@contextlib.contextmanager
def serve_calls(hand_over: Callable[[Callable[[], None]], None]) -> Iterator[None]:
    """While the block runs, :func:`call` from other threads hands its function to ``hand_over``.

    ``hand_over`` gives the job to the thread that entered the block (which must run it); only
    the main thread serves, since only there does SIGINT reach a blocked call.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:
        _server.append(hand_over)
    try:
        yield
    finally:
        with _lock:
            _server.remove(hand_over)


def _forget(ident: int) -> None:
    """Drop a record an interrupt may have left behind (one landing in :func:`user_call`'s own exit)."""
    with _lock:
        call = _calls.pop(ident, None)
        if call is not None and call.interrupted and not call.in_main_thread:
            _raise_in(ident, None)


class _Job:
    def __init__(self, fn: Callable[[], Any]):
        self.fn, self.taken, self.done = fn, False, threading.Event()
        self.result: Any = None
        self.error: BaseException | None = None

    def take(self) -> bool:
        with _lock:
            if self.taken:
                return False
            self.taken = True
            return True

    def __call__(self) -> None:
        if not self.take():
            return
        try:
            self.result = self.fn()
        except BaseException as e:  # raised again in the thread that asked
            _forget(threading.get_ident())
            self.error = e
        finally:
            self.done.set()


def call(fn: Callable[[], Any]) -> Any:
    """``fn()``, in the main thread when it serves (:func:`serve_calls`), else here."""
    with _lock:
        hand_over = _server[-1] if _server and threading.current_thread() is not threading.main_thread() else None
    if hand_over is None:
        try:
            return fn()
        except BaseException:
            _forget(threading.get_ident())
            raise
    job = _Job(fn)
    hand_over(job)
    while not job.done.wait(0.05):
        with _lock:
            serving = hand_over in _server
        if not serving and job.take():  # the main thread stopped serving before it took the job
            return fn()
    if job.error is not None:
        raise job.error
    return job.result
