"""JupyterLab in a real browser: a ``%%chat`` reply grows live in its widget, which then turns into markdown.

JupyterLab runs on loopback with a token, seeing only a temporary ``shardbook-2`` kernelspec
(JUPYTER_PATH) and temporary settings. Debian's chromium, driven by the ``playwright`` package
(never ``playwright install``: no browser is downloaded), opens a copy of the quickstart notebook
with a long ``%%chat`` cell added, runs ``%load_sharded`` and then that cell, and samples the reply's
length while it streams. Screenshots go to ``test-artifacts/``; with ``SHARDBOOK_UPDATE_SCREENSHOT=1``
the final one is copied to ``docs/screenshot.png`` for the README (never by default: an ordinary
test run must leave the working tree as it found it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import nbformat
import pytest
from nbformat.v4 import new_code_cell

from shardbook.kernel.api.fetch import demo_model_dir, is_built
from tests.prerequisites import require

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts"
SCREENSHOT = ROOT / "docs" / "screenshot.png"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
STORY = "%%chat --new --max-new-tokens 80\nWrite a short story about a robot."
SERVER_START_S = 90
KERNEL_START_S = 180
LOAD_S = 300
REPLY_S = 300
SAMPLE_EVERY_S = 0.05
MID_STREAM_CHARS = 150
"""The streaming screenshot is taken once the reply is this long (the whole greedy story is about 390)."""
SMOLLM2 = demo_model_dir("smollm2-135m-instruct")

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.fixture
def sync_playwright():
    """playwright's sync API; a skip (under CI a failure) naming what is missing: model, browser or package."""
    if not is_built(SMOLLM2):
        require(f"demo model not built at {SMOLLM2} (run `shardbook fetch smollm2-135m-instruct`)")
    if not CHROMIUM.exists():
        require(f"{CHROMIUM} is missing: `apt-get install -y chromium` (.ci/setup does it)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        require("the playwright package is missing: `pip install -e .[test]` (.ci/setup does it)")
    return sync_playwright


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_settings(settings_dir: Path) -> None:
    """JupyterLab settings: every cell in the DOM (no windowing), no news or update checks."""
    settings = {
        "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {
            "fetchNews": "false",
            "checkForUpdates": False,
        },
    }
    for name, value in settings.items():
        path = settings_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def prepare_workspace(work: Path) -> Path:
    """``work/notebooks/quickstart.ipynb`` (with the story cell after the load cell) and ``work/configs``."""
    (work / "notebooks").mkdir(parents=True)
    (work / "configs").symlink_to(ROOT / "configs")  # the notebook loads ../configs/smollm2-135m.yaml
    nb = nbformat.read(ROOT / "notebooks" / "quickstart.ipynb", as_version=4)
    load = next(i for i, c in enumerate(nb.cells) if c.source.startswith("%load_sharded"))
    story = new_code_cell(STORY)
    story.id = "browser-story"
    nb.cells.insert(load + 1, story)
    path = work / "notebooks" / "quickstart.ipynb"
    nbformat.write(nb, path)
    return path


def wait_for_server(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + SERVER_START_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"JupyterLab exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    pytest.fail(f"JupyterLab did not answer within {SERVER_START_S} s:\n{log.read_text()[-3000:]}")


def stop_server(base: str, token: str, proc: subprocess.Popen) -> None:
    """Ask the server to shut down (it stops its kernels, and their ranks); force it only if it will not."""
    try:
        request = urllib.request.Request(
            f"{base}/api/shutdown", method="POST", headers={"Authorization": f"token {token}"}
        )
        urllib.request.urlopen(request, timeout=10).close()
        proc.wait(timeout=60)
    except (urllib.error.URLError, OSError, subprocess.TimeoutExpired):
        proc.send_signal(signal.SIGINT)  # jupyter_server cleans up kernels on SIGINT
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
def jupyterlab(tmp_path):
    """A JupyterLab server on loopback: yields (notebook URL, workspace dir); shut down afterwards."""
    prefix = tmp_path / "jupyter"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardbook.kernel.cli.main",
            "install",
            "--nproc",
            "2",
            "--prefix",
            str(prefix),
            "--name",
            "shardbook-2",
        ],
        check=True,
        capture_output=True,
    )
    work = tmp_path / "work"
    prepare_workspace(work)
    write_settings(tmp_path / "lab-settings")
    port, token = free_port(), secrets.token_hex(16)
    env = {
        **os.environ,
        "JUPYTER_PATH": str(prefix / "share" / "jupyter"),
        "JUPYTER_CONFIG_DIR": str(tmp_path / "config"),
        "JUPYTER_RUNTIME_DIR": str(tmp_path / "runtime"),
        "JUPYTERLAB_SETTINGS_DIR": str(tmp_path / "lab-settings"),
        "JUPYTERLAB_WORKSPACES_DIR": str(tmp_path / "lab-workspaces"),
        "PYTHONUNBUFFERED": "1",
    }
    ARTIFACTS.mkdir(exist_ok=True)
    log = ARTIFACTS / "jupyterlab.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_file:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "jupyterlab",
                "--no-browser",
                "--ServerApp.ip=127.0.0.1",
                f"--ServerApp.port={port}",
                "--ServerApp.port_retries=0",
                f"--IdentityProvider.token={token}",
                f"--ServerApp.root_dir={work}",
                "--LabApp.extension_manager=readonly",
                *(["--allow-root"] if os.geteuid() == 0 else []),
            ],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
        try:
            wait_for_server(f"{base}/api/status?token={token}", proc, log)
            kernels = json.loads(urllib.request.urlopen(f"{base}/api/kernelspecs?token={token}", timeout=10).read())
            assert "shardbook-2" in kernels["kernelspecs"], kernels["kernelspecs"].keys()
            yield f"{base}/lab/tree/notebooks/quickstart.ipynb?token={token}", work
        finally:
            stop_server(base, token, proc)


def code_cell(page, text: str):
    """The code cell whose source contains `text`."""
    return page.locator(".jp-CodeCell", has=page.locator(".jp-InputArea-editor", has_text=text))


def run_cell(page, cell) -> None:
    cell.locator(".jp-InputArea-editor").click()
    page.keyboard.press("Shift+Enter")


def scroll_to_top(cell) -> None:
    cell.evaluate("element => element.scrollIntoView({block: 'start'})")


def reply_state(cell) -> dict:
    """The cell's live widget text (None when there is none) and its number of markdown replies, read in one
    step in the page: the widget turns into markdown between two separate locator calls, and a locator
    call on the widget that just left waits out its whole timeout (the CI failure of an earlier stop)."""
    return cell.evaluate(
        """cell => {
            const widget = cell.querySelector('.shardbook-reply');
            return {widget: widget ? widget.textContent : null,
                    markdown: cell.querySelectorAll('.jp-RenderedMarkdown').length};
        }"""
    )


def sample_reply(cell, deadline: float, on_sample) -> tuple[list[int], str]:
    """Lengths of the reply text in the widget, sampled until the widget turns into the markdown reply,
    and the last text seen in the widget."""
    lengths, last_text, started = [], "", time.monotonic()
    while (seen := reply_state(cell))["markdown"] == 0:
        assert time.monotonic() < deadline, f"no markdown reply within {REPLY_S} s; lengths seen {lengths}"
        if seen["widget"] is not None:
            last_text = seen["widget"]
            lengths.append(len(last_text))
            on_sample(lengths)
        time.sleep(SAMPLE_EVERY_S)
    changes = [n for i, n in enumerate(lengths) if i == 0 or n != lengths[i - 1]]
    (ARTIFACTS / "jupyterlab-chat-lengths.json").write_text(
        json.dumps(
            {
                "seconds": round(time.monotonic() - started, 2),
                "num_samples": len(lengths),
                "lengths_as_they_changed": changes,
            }
        )
    )
    return lengths, last_text


def normalized(text: str) -> str:
    return " ".join(text.split())


def test_chat_reply_grows_live_in_jupyterlab(sync_playwright, jupyterlab):
    url, work = jupyterlab
    streaming_shot = ARTIFACTS / "jupyterlab-chat-streaming.png"
    final_shot = ARTIFACTS / "jupyterlab-chat-final.png"
    for shot in (streaming_shot, final_shot):
        shot.unlink(missing_ok=True)
    with sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            user_data_dir=str(work.parent / "chromium-profile"),
            executable_path=str(CHROMIUM),
            headless=True,
            args=CHROMIUM_ARGS,
            viewport={"width": 1280, "height": 900},
        )
        page = context.pages[0] if context.pages else context.new_page()
        try:
            page.goto(url)
            page.locator(".jp-Notebook").wait_for(timeout=60_000)
            # The notebook's own kernel, started and idle (the toolbar's indicator reads idle before it exists too).
            page.locator(".jp-StatusBar-Item", has_text="shardbook (2 ranks, 1 node) | Idle").wait_for(
                timeout=KERNEL_START_S * 1000
            )
            page.keyboard.press("Control+b")  # hide the file browser: a wider notebook in the screenshots

            load = code_cell(page, "%load_sharded")
            run_cell(page, load)
            load.locator(".jp-OutputArea-output", has_text="load time").wait_for(timeout=LOAD_S * 1000)

            story = code_cell(page, "Write a short story about a robot.")
            run_cell(page, story)
            scroll_to_top(load)  # the screenshots show the load summary and the reply under it

            def on_sample(lengths):
                if not streaming_shot.exists() and len(set(lengths) - {0}) >= 3 and lengths[-1] >= MID_STREAM_CHARS:
                    page.screenshot(path=str(streaming_shot))

            lengths, widget_text = sample_reply(story, time.monotonic() + REPLY_S, on_sample)
            markdown_text = story.locator(".jp-RenderedMarkdown").first.inner_text()
            num_widgets_left = story.locator(".shardbook-reply").count()
            story.locator(".jp-OutputArea-output", has_text="tok/s").wait_for(timeout=30_000)  # the status line
            scroll_to_top(load)
            page.screenshot(path=str(final_shot))
        except Exception:
            page.screenshot(path=str(ARTIFACTS / "jupyterlab-failure.png"))
            raise
        finally:
            context.close()

    final = len(widget_text)
    growing = sorted({n for n in lengths if 0 < n <= final})
    assert lengths == sorted(lengths), f"the reply shrank while streaming: {lengths}"
    assert len(growing) >= 3, f"the reply did not grow in steps before its final length {final}: {lengths}"
    assert num_widgets_left == 0, "the reply is shown twice: the live widget stayed beside its markdown"
    assert normalized(markdown_text).startswith(normalized(widget_text)) and len(normalized(markdown_text)) > 100, (
        widget_text,
        markdown_text,
    )
    assert streaming_shot.exists(), (
        f"no screenshot while streaming: the reply never reached {MID_STREAM_CHARS} characters before it ended"
    )
    if os.environ.get("SHARDBOOK_UPDATE_SCREENSHOT") == "1":
        shutil.copyfile(final_shot, SCREENSHOT)
