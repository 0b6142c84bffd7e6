"""The example notebooks: regenerable from make_notebooks.py, and run headless with SmolLM2 on 2 ranks.

The SmolLM2 runs go through the real command line (``python -m shardbook.kernel.cli.main run``) on the
notebooks in place, since they find the config relative to their own folder; the executed copies
go to a temporary directory.
"""

from __future__ import annotations

import html.parser
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import pytest

from shardbook.kernel.api.fetch import demo_model_dir, is_built
from tests.e2e.conftest import ROOT

NOTEBOOKS = ROOT / "notebooks"
SMOLLM2 = demo_model_dir("smollm2-135m-instruct")
needs_smollm2 = pytest.mark.skipif(
    not is_built(SMOLLM2), reason=f"demo model not built at {SMOLLM2} (run `shardbook fetch smollm2-135m-instruct`)"
)
RUN_TIMEOUT_S = 420
"""A whole notebook on a shared 2-core machine: kernel start, load, and a few replies of up to 64 tokens."""


def shardbook_run(notebook: Path, output: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "shardbook.kernel.cli.main",
            "run",
            str(notebook),
            "--nproc",
            "2",
            "--output",
            str(output),
        ],
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT_S,
        check=False,
        env={**os.environ, **(env or {})},
    )


def outputs_of(cell, mime: str) -> list[str]:
    return [out.data[mime] for out in cell.get("outputs", []) if mime in out.get("data", {})]


def chat_replies(nb) -> list[str]:
    """The text/markdown reply shown under each ``%%chat`` cell, in order."""
    replies = []
    for cell in nb.cells:
        if cell.cell_type == "code" and cell.source.startswith("%%chat"):
            shown = outputs_of(cell, "text/markdown")
            assert len(shown) == 1, f"{cell.source!r}: expected one markdown reply, got {cell.outputs}"
            replies.append(shown[0])
    return replies


def normalized(text: str) -> str:
    return " ".join(text.split())


class MarkdownOutputs(html.parser.HTMLParser):
    """The visible text of each output nbconvert rendered from text/markdown
    (not markdown cells, widget state or scripts)."""

    def __init__(self):
        super().__init__()
        self.texts: list[str] = []
        self._depth = 0  # open divs inside the current markdown output; 0 when outside one

    def handle_starttag(self, tag, attrs):
        if tag != "div":
            return
        attributes = dict(attrs)
        if self._depth:
            self._depth += 1
        elif attributes.get("data-mime-type") == "text/markdown" and "jp-OutputArea-output" in (
            attributes.get("class") or ""
        ):
            self._depth = 1
            self.texts.append("")

    def handle_endtag(self, tag):
        if tag == "div" and self._depth:
            self._depth -= 1

    def handle_data(self, data):
        if self._depth:
            self.texts[-1] += data


def test_notebooks_are_generated_from_make_notebooks(tmp_path):
    """The committed notebooks are exactly what make_notebooks.py writes: unexecuted, on shardbook-2."""
    result = subprocess.run(
        [sys.executable, str(NOTEBOOKS / "make_notebooks.py"), str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    for name in ("quickstart.ipynb", "inspect.ipynb", "tools.ipynb"):
        assert (tmp_path / name).read_text() == (NOTEBOOKS / name).read_text(), (
            f"notebooks/{name} differs from what make_notebooks.py writes; run `python notebooks/make_notebooks.py`"
        )
        nb = nbformat.read(NOTEBOOKS / name, as_version=4)
        nbformat.validate(nb)
        assert nb.metadata.kernelspec.name == "shardbook-2"
        assert all(not c.get("outputs") and c.get("execution_count") is None for c in nb.cells if c.cell_type == "code")
        loads = [c.source for c in nb.cells if c.source.startswith("%load_sharded")]
        assert loads, f"{name} loads no model"
        for line in loads:  # notebooks run with their own folder as working directory
            assert (NOTEBOOKS / line.split()[1]).resolve().is_file(), line


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart, run once for the tests below: (completed process, executed notebook)."""
    output = tmp_path_factory.mktemp("quickstart") / "quickstart.ipynb"
    result = shardbook_run(NOTEBOOKS / "quickstart.ipynb", output)
    return result, (nbformat.read(output, as_version=4) if output.exists() else None)


@pytest.mark.slow
@needs_smollm2
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_quickstart_runs_and_answers_paris(quickstart):
    result, nb = quickstart
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    replies = chat_replies(nb)
    assert len(replies) == 3, replies
    greedy = replies[:2]  # the two turns about France; the third is sampled
    assert all("Paris" in reply for reply in greedy), greedy
    assert replies[2].strip(), "the sampled reply is empty"
    for reply in replies:  # printed live, as text, by `shardbook run`
        assert reply.strip() in result.stdout
    shapes = re.findall(r"rank (\d): q_proj global \(576, 576\), local shard \((\d+), 576\)", result.stdout)
    assert sorted(shapes) == [("0", "288"), ("1", "288")], result.stdout
    assert "model.layers.0.self_attn.q_proj.weight" in result.stdout  # the %shards table


@pytest.mark.slow
@needs_smollm2
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_quickstart_html_shows_the_replies(quickstart):
    """nbconvert's HTML shows each reply as rendered markdown, readable without widget JavaScript."""
    from nbconvert import HTMLExporter

    result, nb = quickstart
    assert result.returncode == 0, result.stderr[-5000:]
    body, _ = HTMLExporter().from_notebook_node(nb)
    parser = MarkdownOutputs()
    parser.feed(body)
    shown = [normalized(text) for text in parser.texts]
    replies = [normalized(reply) for reply in chat_replies(nb)]
    assert shown == replies, (shown, replies)
    assert "Paris" in shown[0]


@pytest.mark.slow
@needs_smollm2
@pytest.mark.timeout(RUN_TIMEOUT_S + 60)
def test_inspect_lens_patching_steering_and_histogram(tmp_path):
    output = tmp_path / "inspect.ipynb"
    result = shardbook_run(NOTEBOOKS / "inspect.ipynb", output)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    nb = nbformat.read(output, as_version=4)
    images = [png for cell in nb.cells for png in outputs_of(cell, "image/png")]
    assert len(images) == 5, "expected the logit lens, the patching curve, two %patch heatmaps and the histogram"
    assert "activation patching: metric clean" in result.stdout and "attribution patching:" in result.stdout
    assert "from 32 + 32 prompts" in result.stdout, result.stdout
    assert "model.layers.29:   ' Paris'" in result.stdout, result.stdout  # the lens's last layer says Paris
    clean, corrupt = map(float, re.search(r"P\(' Paris'\): clean ([\d.]+), corrupt ([\d.]+)", result.stdout).groups())
    assert clean > corrupt
    assert "clean (30 tensor(s)) is now on every rank" in result.stdout
    weekend, steered, paris = chat_replies(nb)
    assert weekend.strip() and steered.strip() and normalized(weekend) != normalized(steered), (weekend, steered)
    assert "Paris" in paris
    scores = [h for cell in nb.cells for h in outputs_of(cell, "text/html") if "shardbook-scores" in h]
    assert len(scores) == 1 and scores[0].count("<span title=") >= 2
    assert "runner-up" in result.stdout


@pytest.mark.slow
@pytest.mark.timeout(RUN_TIMEOUT_S + 120)
def test_tools_notebook_runs_a_loop_and_traces_a_step(tmp_path):
    """tools.ipynb on the tiny model test_chat_tools.py teaches to call its tools (SHARDBOOK_TOOLS_MODEL)."""
    from tests.e2e.test_chat_tools import make_tool_model

    model = make_tool_model(tmp_path / "llama")
    output = tmp_path / "tools.ipynb"
    result = shardbook_run(NOTEBOOKS / "tools.ipynb", output, env={"SHARDBOOK_TOOLS_MODEL": str(model)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    assert 'add({"a": 2, "b": 3}) -> 5\nhalve({"x": 5}) -> 2.5\nanswer: It is 2.5.' in result.stdout, result.stdout
    assert "next token: '<tool_call>'" in result.stdout, result.stdout
    [loop] = [c for c in nbformat.read(output, as_version=4).cells if c.source.startswith("%%chat --tools")]
    shown = [out.data["text/plain"] for out in loop.outputs if "[tool]" in out.get("data", {}).get("text/plain", "")]
    assert shown == ['[tool] add({"a": 2, "b": 3}) -> 5', '[tool] halve({"x": 5}) -> 2.5'], loop.outputs
