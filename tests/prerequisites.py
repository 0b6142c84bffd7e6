"""A test's missing prerequisite (a package, a browser, Slurm, root): a skip on a person's machine, a failure in CI.

CI (``CI=true``, as GitHub Actions, GitLab and most runners set it) must run every test: a
prerequisite that its set-up failed to install would otherwise turn whole suites into skips and
let the run pass with the browser test or the Slurm provisioner never exercised.
"""

from __future__ import annotations

import os

import pytest


def in_ci() -> bool:
    """True under a CI runner (``CI`` set to ``true``, ``1`` or ``yes``)."""
    return os.environ.get("CI", "").strip().lower() in ("true", "1", "yes")


def require(missing: str | None) -> None:
    """Nothing when ``missing`` is None; else skip the test, or fail it under CI, saying what is missing."""
    if missing is None:
        return
    if in_ci():
        pytest.fail(f"{missing} (CI is set: a missing prerequisite fails the run instead of skipping)", pytrace=False)
    pytest.skip(missing)
