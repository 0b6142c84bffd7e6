"""%%all, %%rank and %dist through a real 2-rank kernel driven by jupyter_client."""

from __future__ import annotations

import pytest

from tests.driver import interrupt_when

pytestmark = pytest.mark.timeout(120)


def test_all_runs_on_every_rank_with_labels(kernel):
    ex = kernel.run("%%all\nimport torch.distributed as dist\nprint('hello from', dist.get_rank())")
    assert ex.status == "ok", ex.error_text()
    out = ex.stdout()
    assert "[rank 0]\nhello from 0\n" in out
    assert "[rank 1]\nhello from 1\n" in out


def test_label_only_when_rank_changes(kernel):
    ex = kernel.run("%%rank 1\nfor i in range(3):\n    print('line', i)")
    assert ex.stdout() == "[rank 1]\nline 0\nline 1\nline 2\n"


def test_namespaces_persist_per_rank(kernel):
    assert kernel.run("%%all\nimport torch.distributed as dist\nmine = 10 * dist.get_rank()").status == "ok"
    ex = kernel.run("%%all\nprint('mine =', mine)")
    assert "[rank 0]\nmine = 0" in ex.stdout() and "[rank 1]\nmine = 10" in ex.stdout()


def test_rich_display_and_last_value_carry_rank(kernel):
    code = "%%rank 1\nfrom IPython.display import HTML, display\ndisplay(HTML('<b>bold</b>'))\n6 * 7"
    ex = kernel.run(code)
    assert ex.status == "ok", ex.error_text()
    shown = ex.of_type("display_data")
    assert shown[0]["content"]["data"]["text/html"] == "<b>bold</b>"
    assert shown[1]["content"]["data"]["text/plain"] == "42"
    assert all(m["content"]["metadata"]["rank"] == 1 for m in shown)


def test_images_from_a_follower(kernel):
    code = (
        "%%rank 1\nfrom IPython.display import Image, display\nimport base64\n"
        "png = base64.b64decode("
        "'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg==')\n"
        "display(Image(png))"
    )
    ex = kernel.run(code)
    assert "image/png" in ex.of_type("display_data")[0]["content"]["data"]


def test_follower_output_is_live(kernel):
    ex = kernel.run("%%all\nimport time\nprint('first', flush=True)\ntime.sleep(3)\nprint('second')")
    assert ex.status == "ok"
    first = [m for m in ex.of_type("stream") if "first" in m["content"]["text"] and "[rank 1]" in m["content"]["text"]]
    assert first, ex.stdout()
    assert ex.reply_at - first[0]["received_at"] > 2.0, "rank 1's first line only arrived at the end of the cell"


def test_same_error_on_every_rank_shows_once(kernel):
    ex = kernel.run("%%all\n1/0")
    assert ex.status == "error"
    error = ex.error()
    assert error["ename"] == "RankError"
    assert "ranks 0, 1: ZeroDivisionError: division by zero" in ex.error_text()
    assert ex.error_text().count("---- ") == 1


def test_different_errors_show_per_rank(kernel):
    ex = kernel.run("%%all\nimport torch.distributed as dist\nraise ValueError(f'bad on {dist.get_rank()}')")
    text = ex.error_text()
    assert ex.status == "error"
    assert "rank 0: ValueError: bad on 0" in text and "rank 1: ValueError: bad on 1" in text


def test_error_on_one_follower_fails_the_cell(kernel):
    ex = kernel.run("%%all\nimport torch.distributed as dist\nassert dist.get_rank() == 0, 'only rank 0 is fine'")
    assert ex.status == "error"
    assert "rank 1: AssertionError: only rank 0 is fine" in ex.error_text()
    assert kernel.run("%%all\nprint('still fine')").status == "ok"


@pytest.mark.parametrize(
    "spec, expected",
    [("5", "outside the world: this kernel has 2 ranks"), ("x", "bad rank spec 'x'"), ("1-0", "descending")],
)
def test_bad_rank_spec_is_a_usage_error(kernel, spec, expected):
    ex = kernel.run(f"%%rank {spec}\nprint(1)")
    assert ex.status == "error"
    assert ex.reply["content"]["ename"] == "UsageError"  # IPython prints usage errors without a traceback
    assert expected in ex.stderr()


@pytest.mark.parametrize("value", ["-1", "0", "nan", "inf"])
def test_timeout_must_be_a_positive_number_of_seconds(kernel, value):
    ex = kernel.run(f"%%all --timeout {value}\nprint('ran')")
    assert ex.status == "error" and ex.reply["content"]["ename"] == "UsageError"
    assert "positive number of seconds" in ex.stderr()
    assert "ran" not in ex.stdout()


def test_rank_subset_runs_only_there(kernel):
    ex = kernel.run("%%rank 0-1\nimport torch.distributed as dist\nprint('at', dist.get_rank())")
    assert "at 0" in ex.stdout() and "at 1" in ex.stdout()
    ex = kernel.run("%%rank 0\nprint('only zero')")
    assert ex.stdout() == "only zero\n"


def test_collective_in_all(kernel):
    code = (
        "%%all\nimport torch, torch.distributed as dist\nt = torch.ones(1) * (dist.get_rank() + 1)\n"
        "dist.all_reduce(t)\nprint('sum', t.item())"
    )
    ex = kernel.run(code)
    assert ex.stdout().count("sum 3.0") == 2


def test_dist_table(kernel):
    pids = kernel.rank_pids()
    ex = kernel.run("%dist")
    result = ex.of_type("execute_result")[0]["content"]["data"]
    html, text = result["text/html"], result["text/plain"]
    assert "<table" in html
    lines = text.splitlines()
    assert lines[0].split()[:6] == ["rank", "host", "pid", "device", "backend", "state"]
    for rank, pid in pids.items():
        row = lines[1 + rank].split()
        assert row[0] == str(rank) and row[2] == str(pid) and row[3] == "cpu" and row[4] == "gloo"
    assert "idle" in lines[2] and "rss" in lines[2]


def test_interrupt_stops_every_rank(kernel):
    printed = []

    def both_sleeping(msg):  # each rank prints before it sleeps; interrupt once both have
        if msg["msg_type"] == "stream":
            printed.append(msg["content"]["text"])
        return "".join(printed).count("sleeping") == 2

    code = "%%all\nimport time\nprint('sleeping', flush=True)\ntime.sleep(60)"
    ex, elapsed = interrupt_when(kernel, code, both_sleeping, wait_s=20, timeout=30)
    assert ex.status == "error"
    assert "ranks 0, 1: KeyboardInterrupt" in ex.error_text()
    assert elapsed < 5, f"interrupt took {elapsed:.1f} s"
    assert kernel.run("%%all\nprint('after')").stdout().count("after") == 2


def test_text_that_is_not_unicode_never_takes_down_a_rank(kernel):
    """Lone surrogates printed, displayed and raised on every rank: shown as U+FFFD, and every rank lives on."""
    code = (
        "%%all\nfrom IPython.display import display\nprint('a\\ud800b')\n"
        "display({'text/plain': 'shown \\udce9'}, raw=True)\nraise ValueError('bad \\udfff')"
    )
    ex = kernel.run(code, timeout=30)
    assert ex.status == "error"
    assert ex.stdout().count("a\ufffdb") == 2, ex.stdout()
    assert [m["content"]["data"]["text/plain"] for m in ex.of_type("display_data")] == ["shown \ufffd"] * 2
    assert "ranks 0, 1: ValueError: bad \ufffd" in ex.error_text()
    after = kernel.run("%%all\nprint('alive')", timeout=30)
    assert after.status == "ok" and after.stdout().count("alive") == 2, after.error_text() + after.stderr()


def test_bytes_written_to_stdout_buffer_on_every_rank(kernel):
    ex = kernel.run(
        "%%all\nimport sys\nsys.stdout.buffer.write(b'caf\\xc3')\nsys.stdout.buffer.write(b'\\xa9 \\xff\\n')"
    )
    assert ex.status == "ok", ex.error_text()
    assert ex.stdout().count("café \ufffd\n") == 2, ex.stdout()


def test_an_exception_whose_str_raises_keeps_its_type(kernel):
    code = (
        "%%rank 1\nclass Unprintable(Exception):\n    def __str__(self):\n"
        "        raise RuntimeError('no')\nraise Unprintable()"
    )
    ex = kernel.run(code)
    assert ex.status == "error"
    assert "rank 1: Unprintable: (the Unprintable's message could not be shown" in ex.error_text(), ex.error_text()
