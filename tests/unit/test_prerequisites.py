"""A missing prerequisite skips a test on a person's machine and fails it under CI."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from tests.prerequisites import require

ROOT = Path(__file__).resolve().parents[2]


def test_nothing_missing_is_neither_skip_nor_failure(monkeypatch):
    monkeypatch.setenv("CI", "true")
    require(None)


def test_a_missing_prerequisite_skips_outside_ci(monkeypatch):
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception, match="chromium is missing"):
        require("chromium is missing")


@pytest.mark.parametrize("value", ["true", "1"])
def test_a_missing_prerequisite_fails_under_ci(monkeypatch, value):
    monkeypatch.setenv("CI", value)
    with pytest.raises(pytest.fail.Exception, match="chromium is missing.*CI is set"):
        require("chromium is missing")


def cannot_install(ci: str) -> subprocess.CompletedProcess:
    """.ci/setup's ``cannot_install`` alone, called as the set-up calls it after a failed install."""
    setup = (ROOT / ".ci" / "setup").read_text()
    function = setup[setup.index("cannot_install() {") : setup.index("\n}\n", setup.index("cannot_install() {")) + 3]
    script = f'set -euo pipefail\n{function}\nfalse || cannot_install chromium "the browser test"\necho went on\n'
    return subprocess.run(
        ["bash", "-c", script], env={"CI": ci, "PATH": "/usr/bin:/bin"}, capture_output=True, text=True
    )


def test_the_setup_goes_on_outside_ci_and_stops_under_it():
    local = cannot_install("")
    assert local.returncode == 0 and "went on" in local.stdout and "will be skipped" in local.stderr
    ci = cannot_install("true")
    assert ci.returncode == 1 and "went on" not in ci.stdout and "set-up fails" in ci.stderr
