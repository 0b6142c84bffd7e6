"""Fixtures for the multi-process tests: the `ranks` harness (tests/ranks.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:  # `tests.ranks` and `tests.tiny` must import here and in the spawned ranks
    sys.path.insert(0, str(REPO_ROOT))

from tests.ranks import run_ranks  # noqa: E402


@pytest.fixture(scope="session")
def ranks():
    """The `run_ranks` function, for tests that spawn process groups."""
    return run_ranks
