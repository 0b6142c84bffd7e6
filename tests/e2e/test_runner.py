"""`shardbook run`: notebooks executed headless on a temporary 2-rank kernel, through the real CLI."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

from tests.e2e.conftest import ROOT, gone, wait_until

pytestmark = pytest.mark.timeout(300)

HELLO = ROOT / "notebooks" / "hello_ranks.ipynb"


def shardbook_run(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "shardbook.kernel.cli.main", "run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def write_notebook(path: Path, *sources: str) -> Path:
    nbformat.write(new_notebook(cells=[new_code_cell(s) for s in sources]), path)
    return path


def test_hello_ranks_runs_in_cell_order_and_leaves_no_ranks(tmp_path):
    notebook = Path(shutil.copy(HELLO, tmp_path / "hello_ranks.ipynb"))
    result = shardbook_run(str(notebook), "--nproc", "2")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    hellos = [out.index(f"hello from rank {r} of 2") for r in (0, 1)]
    sums = [out.index(f"rank {r}: all_reduce sum of rank + 1 over 2 ranks = 3") for r in (0, 1)]
    only_one = out.index("[rank 1]\nonly rank 1 runs this cell")
    assert out.index("rank  host  pid") < min(hellos)
    assert max(hellos) < min(sums) and max(sums) < only_one < out.index("rank 0 is the kernel")
    assert re.findall(r"--- cell (\d+)/11: ", result.stderr) == ["3", "5", "7", "9", "11"]

    executed = nbformat.read(tmp_path / "hello_ranks.out.ipynb", as_version=4)  # the default --output
    code = [c for c in executed.cells if c.cell_type == "code"]
    assert all(c.outputs for c in code) and [c.execution_count for c in code] == [1, 2, 3, 4, 5]
    assert "[rank 1]\nhello from rank 1 of 2" in "".join(o.get("text", "") for o in code[1].outputs)

    pids = [int(p) for p in re.findall(r"hello from rank \d of 2 \(pid (\d+)", out)]
    assert len(pids) == 2
    assert wait_until(lambda: all(gone(p) for p in pids), timeout=15), f"ranks {pids} outlived the run"


def test_failing_all_cell_stops_the_run_with_the_rank_error(tmp_path):
    notebook = write_notebook(
        tmp_path / "fails.ipynb",
        "%%all\nprint('before the failure')",
        "%%all\nimport torch.distributed as dist\nassert dist.get_rank() == 0, 'only rank 0 is fine'",
        "print('never printed')",
    )
    output = tmp_path / "executed.ipynb"
    result = shardbook_run(str(notebook), "--nproc", "2", "--output", str(output))
    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout.count("before the failure") == 2
    assert "never printed" not in result.stdout
    assert "rank 1: AssertionError: only rank 0 is fine" in result.stderr
    assert "cell 2/3 (index 1) failed with RankError" in result.stderr
    assert "    %%all\n    import torch.distributed as dist" in result.stderr
    executed = nbformat.read(output, as_version=4)
    assert executed.cells[1].outputs[-1].output_type == "error"
    assert executed.cells[2].outputs == []


def test_output_is_live_and_a_cell_past_the_timeout_is_interrupted(tmp_path):
    notebook = write_notebook(
        tmp_path / "slow.ipynb", "%%all\nimport time\nprint('sleeping', flush=True)\ntime.sleep(3600)"
    )
    with subprocess.Popen(
        [sys.executable, "-m", "shardbook.kernel.cli.main", "run", str(notebook), "--nproc", "2", "--timeout", "5"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    ) as proc:
        first_line_at = next(time.monotonic() for line in proc.stdout if "sleeping" in line)
        stdout = proc.stdout.read()
        stderr = proc.stderr.read()
    ended_at = time.monotonic()
    assert proc.returncode == 1, stdout + stderr
    assert "ran past --timeout 5 s and was interrupted on every rank" in stderr
    assert stdout.count("sleeping") == 1  # the other rank's line; the first was read live
    assert ended_at - first_line_at > 3, "the cell's output only arrived when it ended"


def test_rich_outputs_print_as_text_and_widget_state_is_saved(tmp_path):
    notebook = write_notebook(
        tmp_path / "rich.ipynb",
        "from IPython.display import Markdown, display\ndisplay(Markdown('**bold** reply'))\n6 * 7",
        "from IPython.display import Image\nimport base64\nImage(base64.b64decode("
        "'iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=='))",
        "from IPython.display import display\ndisplay({'image/png': 'iVBORw0KGgo='}, raw=True)",
        "import ipywidgets\nipywidgets.IntSlider(value=7)",
    )
    result = shardbook_run(str(notebook), "--nproc", "1", "--output", str(tmp_path / "out.ipynb"))
    assert result.returncode == 0, result.stderr
    assert result.stdout == (
        "**bold** reply\n42\n<IPython.core.display.Image object>\n"
        "[image/png output, not shown in a terminal]\n"  # a widget's repr is nothing to read
    )
    states = nbformat.read(tmp_path / "out.ipynb", as_version=4).metadata.widgets[
        "application/vnd.jupyter.widget-state+json"
    ]["state"]
    assert [s["state"]["value"] for s in states.values() if s["model_name"] == "IntSliderModel"] == [7]


def test_nproc_defaults_to_the_notebooks_kernelspec(tmp_path):
    nb = new_notebook(
        cells=[new_markdown_cell("nothing to run")],
        metadata={"kernelspec": {"name": "shardbook-3", "display_name": "shardbook (3 ranks, 1 node)"}},
    )
    nbformat.write(nb, tmp_path / "empty.ipynb")
    result = shardbook_run(str(tmp_path / "empty.ipynb"))
    assert result.returncode == 0, result.stderr
    assert "3 rank(s), from the notebook's kernelspec shardbook-3" in result.stderr


@pytest.mark.parametrize(
    "case, args, expected",
    [
        ("missing", ["nope.ipynb"], "nope.ipynb does not exist"),
        ("directory", ["."], "is a directory; give the path of an .ipynb file"),
        ("bad json", ["bad.ipynb"], "bad.ipynb is not a valid Jupyter notebook (Expecting property name"),
        (
            "not a notebook",
            ["other.ipynb"],
            'other.ipynb is not a valid Jupyter notebook (the JSON has no top-level "nbformat" field',
        ),
        (
            "invalid notebook",
            ["invalid.ipynb"],
            "invalid.ipynb is not a valid Jupyter notebook (The notebook is invalid",
        ),
        ("no output dir", ["good.ipynb", "--output", "missing/out.ipynb"], "directory missing does not exist"),
        ("bad nproc", ["good.ipynb", "--nproc", "0"], "--nproc must be at least 1"),
        ("bad timeout", ["good.ipynb", "--timeout", "0"], "--timeout must be a positive number"),
    ],
)
def test_unusable_input_exits_2_before_starting_a_kernel(tmp_path, monkeypatch, case, args, expected):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "bad.ipynb").write_text("{ this is not json")
    (tmp_path / "other.ipynb").write_text('{"cells": []}')
    (tmp_path / "invalid.ipynb").write_text('{"nbformat": 4, "nbformat_minor": 5, "cells": []}')
    write_notebook(tmp_path / "good.ipynb", "print(1)")
    result = shardbook_run(*args, timeout=60)
    assert result.returncode == 2, (case, result.stderr)
    assert expected in result.stderr
    assert result.stderr.startswith("shardbook run: error: ")
    assert not list(tmp_path.glob("*.out.ipynb"))
