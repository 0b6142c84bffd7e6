"""Check scripts (``tests/unit/*_check.py``) run in a process of their own, each a world of one rank with a
process-wide runtime: what one found, read from the JSON line it prints last."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_check(script: Path, *args: Any, timeout: float, env: dict[str, str] | None = None) -> dict:
    """The findings of `script` run with `args` and one CPU thread (`env` added to this process's), within
    `timeout` seconds; a script that fails fails the test with the end of its stderr."""
    done = subprocess.run(
        [sys.executable, str(script), *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})},
    )
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
