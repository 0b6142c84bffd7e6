"""A cell run with its output captured (every rank's ``%%all`` part), in a real IPython shell."""

from __future__ import annotations

import pytest

from shardbook.rankd.control import protocol
from shardbook.rankd.control.capture import make_follower_shell, run_cell


@pytest.fixture(scope="module")
def shell():
    return make_follower_shell()


def test_outputs_reach_the_sink_of_their_own_cell(shell):
    for n in range(3):
        seen: list[tuple] = []
        sink = seen.append  # bound now: each cell's sink is its own list's append
        reply = run_cell(
            shell,
            f"from IPython.display import display\ndisplay({n})\n{n} + 100",
            lambda *m, add=sink: add(m),
            store_history=False,
        )
        assert reply["status"] == "ok"
        assert [(t, p["data"]["text/plain"]) for t, p in seen] == [
            (protocol.DISPLAY, str(n)),
            (protocol.RESULT, str(n + 100)),
        ]


def test_captured_cells_leave_no_callbacks_behind(shell):
    """Every captured cell used to register two more event callbacks (IPython 9's DisplayPublisher), so each later
    cell ran one more per earlier cell: the per-cell cost of %%all grew with the session."""

    def callbacks() -> int:
        return sum(len(shell.events.callbacks[e]) for e in ("pre_execute", "post_execute"))

    run_cell(shell, "pass", lambda *m: None, store_history=False)
    before = callbacks()
    for _ in range(20):
        run_cell(shell, "pass", lambda *m: None, store_history=False)
    assert callbacks() == before
