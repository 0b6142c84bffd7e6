"""The foreground reply: interrupts call its stop instead of raising KeyboardInterrupt, and the stop button finds it."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from shardbook.kernel.api.chat import sigint_calls
from shardbook.kernel.ranks.foreground import stop_foreground_reply


@pytest.fixture
def usr1_interrupts():
    """SIGINT and SIGUSR1 raising KeyboardInterrupt, as the terminal chat sets them (SIGUSR1 is its Ctrl-C under
    `chat --slurm`). SIGINT is set too: a pytest started in the background by a shell without job control
    (`nohup pytest &`, some CI runners) inherits SIGINT ignored, and Python then leaves it so."""
    previous = {signum: signal.signal(signum, signal.default_int_handler) for signum in (signal.SIGINT, signal.SIGUSR1)}
    yield
    for signum, handler in previous.items():
        signal.signal(signum, handler)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGUSR1])
def test_every_interrupt_signal_calls_the_stop_and_never_raises(usr1_interrupts, signum):
    """Before, only SIGINT was caught: `chat --slurm`'s Ctrl-C (SIGUSR1) raised KeyboardInterrupt in the middle of
    the reply's code, e.g. inside the stop of a first press or before the turn was recorded, and the turn was lost."""
    stops = []
    try:
        with sigint_calls(lambda: stops.append(1)):
            for _ in range(5):  # rapid presses
                os.kill(os.getpid(), signum)
            for _ in range(3):  # Python code: each pending signal is handled by now
                pass
    except KeyboardInterrupt:
        pytest.fail(f"signal {signum} raised KeyboardInterrupt inside sigint_calls")
    assert stops == [1] * 5
    assert signal.getsignal(signal.SIGUSR1) is signal.default_int_handler
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_stop_button_stops_the_innermost_foreground_reply_only_while_it_lives():
    stops = []
    assert not stop_foreground_reply()
    with sigint_calls(lambda: stops.append("outer")):
        with sigint_calls(lambda: stops.append("inner")):
            assert stop_foreground_reply()
        assert stop_foreground_reply()
    assert not stop_foreground_reply()
    assert stops == ["inner", "outer"]


def test_outside_the_main_thread_nothing_is_registered():
    seen = []

    def reply():
        with sigint_calls(lambda: seen.append("stopped")):
            seen.append(stop_foreground_reply())

    thread = threading.Thread(target=reply)
    thread.start()
    thread.join(10)
    assert seen == [False]
