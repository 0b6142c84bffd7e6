"""Rendering without processes: rank labels, error grouping, the %dist and %shards tables."""

from __future__ import annotations

from shardbook.kernel.ranks.failures import group_errors, outcome_errors
from shardbook.kernel.ranks.pool import Command, Outcome
from shardbook.magics.errors import RankError, raise_for_outcome, render
from shardbook.magics.relay import RankRelay
from shardbook.magics.views.dist_table import dist_text, format_bytes
from shardbook.magics.views.tables import shards_table
from shardbook.rankd.control import protocol


class Recorder:
    def __init__(self):
        self.out = []

    def stream(self, name, text):
        self.out.append(("stream", name, text))

    def display(self, data, metadata, transient):
        self.out.append(("display", data, metadata))


def test_label_written_when_the_rank_changes():
    rec = Recorder()
    relay = RankRelay(rec, label_ranks=True)
    for rank, text in [(0, "a\n"), (0, "b\n"), (1, "c\n"), (0, "d\n")]:
        relay(rank, protocol.STREAM, {"name": "stdout", "text": text})
    assert "".join(t for _, _, t in rec.out) == "[rank 0]\na\nb\n[rank 1]\nc\n[rank 0]\nd\n"


def test_label_starts_on_a_new_line_after_a_partial_line():
    rec = Recorder()
    relay = RankRelay(rec, label_ranks=True)
    relay(0, protocol.STREAM, {"name": "stdout", "text": "no newline"})
    relay(1, protocol.STREAM, {"name": "stdout", "text": "x\n"})
    assert "".join(t for _, _, t in rec.out) == "[rank 0]\nno newline\n[rank 1]\nx\n"


def test_display_carries_the_rank_and_no_labels_for_a_world_of_one():
    rec = Recorder()
    relay = RankRelay(rec, label_ranks=False)
    relay(0, protocol.RESULT, {"data": {"text/plain": "42"}, "metadata": {}})
    assert rec.out == [("display", {"text/plain": "42"}, {"rank": 0})]


def test_progress_only_from_rank_0():
    seen = []
    relay = RankRelay(Recorder(), label_ranks=True, on_progress=seen.append)
    relay(1, protocol.PROGRESS, {"step": "read", "done": 1, "total": 2})
    relay(0, protocol.PROGRESS, {"step": "read", "done": 2, "total": 2})
    assert seen == [{"step": "read", "done": 2, "total": 2}]


def outcome(replies, stuck=()):
    command = Command("c", "exec", sorted({*replies, *stuck}), lambda *a: None, lambda t: None)
    command.replies.update(replies)
    return Outcome(command, stuck=list(stuck))


def err(ename, evalue):
    return {"status": "error", "error": {"ename": ename, "evalue": evalue, "traceback": [f"tb {evalue}"]}}


def test_same_error_grouped_once_with_its_ranks():
    groups = group_errors({0: err("E", "x")["error"], 1: err("E", "x")["error"], 2: err("F", "y")["error"]})
    assert [(ranks, e["ename"]) for ranks, e in groups] == [([0, 1], "E"), ([2], "F")]


def test_outcome_ok_raises_nothing_and_failures_raise_a_rank_error():
    raise_for_outcome(outcome({0: {"status": "ok"}, 1: {"status": "ok"}}))
    try:
        raise_for_outcome(outcome({0: {"status": "ok"}, 1: err("ValueError", "bad")}, stuck=[2]))
    except RankError as e:
        assert "rank 1: ValueError: bad" in str(e) and "rank 2: RankStuck" in str(e)
        stb = render(e)
        assert stb[0] == "RankError: 2 rank(s) failed" and "tb bad" in stb
    else:
        raise AssertionError("no RankError")


def test_stuck_and_timed_out_ranks_are_errors():
    o = outcome({0: {"status": "ok"}}, stuck=[1])
    o.timed_out = True
    assert outcome_errors(o)[1]["evalue"].startswith("timed out")


def test_dist_text_table():
    rows = [
        {
            "rank": 0,
            "host": "h",
            "pid": 1,
            "device": "cpu",
            "backend": "gloo",
            "state": "idle",
            "memory": {"rss": 3 * 2**20},
        },
        {
            "rank": 1,
            "host": "h",
            "pid": 2,
            "device": "cpu",
            "backend": "gloo",
            "state": "dead",
            "dead_reason": "gone",
            "memory": {},
        },
    ]
    lines = dist_text(rows).splitlines()
    assert lines[0].split() == ["rank", "host", "pid", "device", "backend", "state", "memory"]
    assert "rss 3.0 MiB" in lines[1] and "dead (gone)" in lines[2]
    assert format_bytes(512) == "512 B" and format_bytes(3 * 2**30) == "3.0 GiB"


def test_shards_table_text():
    rows = [{"name": "w", "shape": [4, 2], "dtype": "float32", "placement": "S(0)", "local": {0: [2, 2], 1: [2, 2]}}]
    text = repr(shards_table(rows, 2, "w"))
    assert text.splitlines()[2].split() == ["w", "[4,", "2]", "float32", "S(0)", "[2,", "2]", "[2,", "2]"]


def test_collective_timeouts_advise_a_restart():
    from shardbook.kernel.ranks.failures import describe_failures

    timed_out = outcome(
        {0: err("GenerationError", "rank 0: gloo Timed out waiting 5000ms"), 1: err("RuntimeError", "boom")}
    )
    assert "restart the kernel" in describe_failures(timed_out)
    plain = outcome({0: err("ValueError", "bad"), 1: {"status": "ok"}})
    assert "restart" not in describe_failures(plain)


def test_text_progress_line_rewritten_in_place_and_closed():
    import io

    from shardbook.kernel.api.progress import TextProgress

    stream = io.StringIO()
    progress = TextProgress("loading", stream=stream)
    progress.update("read", 45, 90)
    progress.update("read", 50, 90)  # within 0.1 s of the last line and not the step's end: skipped
    progress.update("finalise", 1, 1)
    progress.close(ok=True)
    lines = stream.getvalue().split("\r")[1:]
    assert lines[0].startswith("loading [#############-------]  67% reading weights 45/90")
    assert lines[1].startswith("loading [####################] 100% finishing 1/1") and lines[1].endswith("\n")
    assert len(lines) == 2


def test_scores_view_colours_tokens_and_lists_alternatives():
    from shardbook.magics.views.chat_view import ScoresView

    steps = [
        {
            "token_id": 5,
            "text": "Paris",
            "prob": 0.9,
            "alternatives": [
                {"token_id": 5, "text": "Paris", "prob": 0.9},
                {"token_id": 7, "text": "<b>Lyon", "prob": 0.05},
            ],
        },
        {"token_id": 2, "text": "", "prob": 0.2, "alternatives": []},
    ]
    view = ScoresView(steps)
    page = view._repr_html_()
    assert "hsl(108, 70%, 80%)" in page and "hsl(24, 70%, 80%)" in page  # sure in green, unsure in red
    assert (
        "&#x27;&lt;b&gt;Lyon&#x27; 0.050" in page and "<b>Lyon" not in page
    )  # the alternative, escaped, in the tooltip
    assert repr(view) == "'Paris':0.90 '⟨2⟩':0.20"


def test_shardbook_run_prints_a_chat_reply_not_its_widget_repr():
    from nbformat.v4 import new_output

    from shardbook.kernel.cli.run import output_text

    widget = new_output(
        "display_data",
        data={
            "text/plain": "HTML(value=\"<div class='shardbook-reply'>Par</div>\")",
            "application/vnd.jupyter.widget-view+json": {"model_id": "abc", "version_major": 2, "version_minor": 0},
        },
    )
    final = new_output("display_data", data={"text/markdown": "Paris.", "text/plain": "Paris."})
    assert output_text(widget) + output_text(final) == "Paris.\n"


def test_dist_table_shows_the_slurm_node_and_job_when_there_is_one():
    from shardbook.magics.views.dist_table import dist_html, dist_text

    rows = [
        {"rank": r, "host": "h", "pid": r, "device": "cpu", "backend": "gloo", "state": "idle", "memory": {}}
        for r in range(2)
    ]
    assert "slurm" not in dist_text(rows)
    rows[0]["slurm"], rows[1]["slurm"] = "n1 job 7", "n2 job 7"
    text = dist_text(rows)
    assert text.splitlines()[0].split()[:3] == ["rank", "host", "slurm"]
    assert "n2 job 7" in text.splitlines()[2] and "<td>n1 job 7</td>" in dist_html(rows)
