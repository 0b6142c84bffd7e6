"""The reply rank 0's main thread waits for, and how an interrupt stops it without a KeyboardInterrupt.

A caller that waits for a reply in the main thread (the ``%%chat`` magic, ``ChatStream.wait``, the
terminal chat) holds :func:`sigint_calls` for as long as the stream lives. Within it, the signals that
would raise KeyboardInterrupt call the stream's stop instead, and the stop is registered as the
*foreground reply*: the kernel's stop button (``magics/interrupts.py``) calls it directly through
:func:`stop_foreground_reply` and sends no signal at all. A press then never lands in the caller's own
code (which records the turn) nor in IPython's or ipykernel's code after it, whichever path the reply
takes (the continuous batch or a reply alone) and however often the button is pressed.

It also knows which cell runs (:func:`running_cell`, kept by the stop button's ``CellActivity``): a sequence
a cell submits to the continuous batch is that cell's, and the stop button stops the running cell's
sequences only, never an HTTP client's.
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_stops: list[Callable[[], None]] = []
_num_entered = 0
_cell: object | None = None


def interrupt_signals() -> list[signal.Signals]:
    """SIGINT, and SIGUSR1 where it raises KeyboardInterrupt too (the terminal chat's Ctrl-C under ``--slurm``)."""
    usr1 = getattr(signal, "SIGUSR1", None)
    extra = [usr1] if usr1 is not None and signal.getsignal(usr1) is signal.default_int_handler else []
    return [signal.SIGINT, *extra]


@contextmanager
def sigint_calls(fn: Callable[[], None]) -> Iterator[None]:
    """Within the block, an interrupt calls ``fn`` instead of raising KeyboardInterrupt wherever the code happens
    to be, and the stop button calls ``fn`` directly (see the module).

    Only the main thread receives signals; elsewhere this does nothing (no KeyboardInterrupt lands there).
    """
    global _num_entered
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with _lock:  # registered first and forgotten last: while it is, a press never becomes a signal
        _stops.append(fn)
        _num_entered += 1
    previous = {}
    try:
        for signum in interrupt_signals():
            previous[signum] = signal.signal(signum, lambda signum, frame: fn())
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        with _lock:
            _stops.remove(fn)


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """Within the block (rank 0's own code between replies: a tool of a tool loop), the stop button raises
    KeyboardInterrupt in the main thread as a SIGINT does, even in a ``%%chat`` cell whose reply has started
    (which otherwise gets no SIGINT). The signal wakes a blocking call (``time.sleep``, a socket read)."""
    if threading.current_thread() is not threading.main_thread():  # no signal lands elsewhere: as sigint_calls
        yield
        return
    main = threading.main_thread().ident

    def interrupt() -> None:
        signal.pthread_kill(main, signal.SIGINT)

    previous = signal.signal(signal.SIGINT, signal.default_int_handler)  # within an outer sigint_calls too
    with _lock:
        _stops.append(interrupt)
    try:
        yield
    finally:
        with _lock:
            _stops.remove(interrupt)
        signal.signal(signal.SIGINT, previous)


def stop_foreground_reply() -> bool:
    """Stop the reply the main thread waits for (the innermost, if nested); False when none does."""
    with _lock:
        fn = _stops[-1] if _stops else None
    if fn is None:
        return False
    fn()
    return True


def num_entered() -> int:
    """How many foreground replies have started in this process (a cell compares it before and after)."""
    with _lock:
        return _num_entered


def cell_started() -> None:
    """A cell starts running (IPython's ``pre_run_cell`` of the outermost cell): it gets an owner token of its own."""
    global _cell
    _cell = object()


def cell_ended() -> None:
    global _cell
    _cell = None


def running_cell() -> object | None:
    """The running cell's owner token, None while no cell runs."""
    return _cell
