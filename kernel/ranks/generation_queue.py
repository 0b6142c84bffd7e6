"""One FIFO line for the ranks: %%chat cells, terminal questions, HTTP requests and loads take turns.

The ranks run one generation at a time (every rank steps through the same ``generate``), so
whoever wants them enters the :class:`GenerationQueue` and waits for its :class:`Turn`. HTTP
requests enter ``bounded``: when ``max_waiting`` of them already wait, :class:`QueueFull` tells
the server to answer 429. A waiting turn leaves the queue (its client left, its cell was
interrupted); the running turn is stopped through the callback its owner set, and finishes.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

DEFAULT_MAX_WAITING = 16
CHAT_SOURCE = "chat"
"""The source of replies that cell code asks for (%%chat, ChatModel, the terminal chat)."""
HTTP_SOURCE = "http"
"""The source of an HTTP request's reply taken alone (`%serve --no-batch`, a model the batch cannot hold)."""


class QueueFull(RuntimeError):
    """Too many requests already wait; ``retry_after_s`` is a guess at when a place frees up."""

    def __init__(self, num_waiting: int, retry_after_s: int):
        super().__init__(f"{num_waiting} requests are already waiting for the model; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass(eq=False)
class Turn:
    """One place in the line: waiting, then running, then finished (or left the queue while waiting)."""

    queue: GenerationQueue
    source: str
    bounded: bool
    entered_at: float = field(default_factory=time.monotonic)
    started_at: float | None = None
    state: str = "waiting"
    on_stop: Callable[[], None] | None = None
    """Set by the owner: stops the running generation (the stop button, a client that left)."""

    @property
    def waited_s(self) -> float:
        return (self.started_at or time.monotonic()) - self.entered_at

    def wait(self) -> bool:
        """Block until this turn runs (True), or until it leaves the queue while waiting (False)."""
        return self.queue._wait(self)

    def leave(self) -> bool:
        """Leave the queue if still waiting; True if it was waiting."""
        return self.queue._leave(self)

    def finish(self) -> None:
        """The running turn is over: the next one starts."""
        self.queue._finish(self)


class GenerationQueue:
    """Turns in arrival order; one runs at a time."""

    def __init__(self, max_waiting: int = DEFAULT_MAX_WAITING):
        self.max_waiting = max_waiting
        self.running: Turn | None = None
        self._waiting: collections.deque[Turn] = collections.deque()
        self._cond = threading.Condition()
        self._last_run_s = 5.0

    def enter(self, source: str, *, bounded: bool = False) -> Turn:
        """A new turn at the end of the line; QueueFull if ``bounded`` and the bounded places are taken."""
        with self._cond:
            num_bounded = sum(t.bounded for t in self._waiting)
            if bounded and num_bounded >= self.max_waiting:
                raise QueueFull(num_bounded, retry_after_s=max(1, round(self._last_run_s * (len(self._waiting) + 1))))
            turn = Turn(self, source, bounded)
            self._waiting.append(turn)
            self._cond.notify_all()
            return turn

    @contextmanager
    def take_turn(self, source: str) -> Iterator[Turn]:
        """Wait (interruptibly) for a turn, hold it for the block, then finish (or leave the queue, if it never ran)."""
        turn = self.enter(source)
        try:
            turn.wait()
            yield turn
        finally:
            if not turn.leave():
                turn.finish()

    def stop_running(self, *, spare: tuple[str, ...] = ()) -> Turn | None:
        """Stop the running generation through its owner's callback; the turn stopped, None when none runs (or
        its source is one of `spare`)."""
        with self._cond:
            turn = self.running
        if turn is None or turn.on_stop is None or turn.source in spare:
            return None
        turn.on_stop()
        return turn

    def num_waiting(self) -> int:
        with self._cond:
            return len(self._waiting)

    def describe(self) -> str:
        with self._cond:
            running = self.running.source if self.running else "nothing"
            return f"running {running}, {len(self._waiting)} waiting (at most {self.max_waiting} HTTP requests)"

    # --- Turn's side ---------------------------------------------------------------------
    def _wait(self, turn: Turn) -> bool:
        with self._cond:
            while turn.state == "waiting" and not (self.running is None and self._waiting[0] is turn):
                self._cond.wait(0.5)
            if turn.state != "waiting":
                return False
            self._waiting.popleft()
            turn.state, turn.started_at = "running", time.monotonic()
            self.running = turn
            return True

    def _leave(self, turn: Turn) -> bool:
        with self._cond:
            if turn.state != "waiting":
                return False
            turn.state = "left"
            self._waiting.remove(turn)
            self._cond.notify_all()
            return True

    def _finish(self, turn: Turn) -> None:
        with self._cond:
            if turn.state != "running":
                return
            turn.state = "finished"
            self._last_run_s = time.monotonic() - (turn.started_at or time.monotonic())
            if self.running is turn:
                self.running = None
            self._cond.notify_all()
