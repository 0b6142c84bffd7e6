"""An interrupt reaches a user function inside a command, including one the command calls after the interrupt."""

from __future__ import annotations

import threading
import time

import pytest

from shardbook.rankd.control import user_calls


def run_user_function(ran: list[str]) -> None:
    with user_calls.user_call("intervention 'f' at model.layers.1.mlp"):
        ran.append("f")


def test_a_function_called_after_the_interrupt_does_not_run():
    user_calls.begin_command()
    assert not user_calls.interrupted()
    user_calls.interrupt_calls()  # the stop button, while the rank was still in the forward
    assert user_calls.interrupted()
    ran: list[str] = []
    with pytest.raises(KeyboardInterrupt):
        run_user_function(ran)
    assert ran == [] and user_calls.running() == []
    with pytest.raises(KeyboardInterrupt):  # every later one in the same command too
        user_calls.call(lambda: run_user_function(ran))
    assert ran == []


def test_the_next_command_runs_its_functions_again():
    user_calls.interrupt_calls()
    user_calls.begin_command()
    ran: list[str] = []
    run_user_function(ran)
    assert ran == ["f"]


def test_a_loop_in_another_thread_is_interrupted_inside_the_function():
    user_calls.begin_command()
    inside, outcome = threading.Event(), []

    def loops() -> None:
        try:
            with user_calls.user_call("intervention 'loops' at model.layers.0"):
                inside.set()
                while True:
                    time.sleep(0.001)
        except KeyboardInterrupt:
            outcome.append("interrupted")

    thread = threading.Thread(target=loops)
    thread.start()
    assert inside.wait(10)
    assert user_calls.interrupt_calls() and thread.join(10) is None
    assert outcome == ["interrupted"] and not thread.is_alive()
    user_calls.begin_command()
