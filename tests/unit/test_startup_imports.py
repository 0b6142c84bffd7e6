"""What rank 0 imports before a model is loaded: transformers (about 1 s of a 2-core machine's start-up) waits."""

from __future__ import annotations

import subprocess
import sys

LOAD_THE_MAGICS = """
import sys
from IPython.core.interactiveshell import InteractiveShell
shell = InteractiveShell.instance()
shell.run_line_magic("load_ext", "shardbook.magics")
from shardbook.kernel.ranks.runtime import get_runtime
get_runtime(shell)  # the ranks start in a thread: wait for it, so its imports count too
assert "shardbook.magics.generate" in sys.modules, "the magics did not load"
print("transformers imported:", "transformers" in sys.modules)
"""


def test_loading_the_magics_does_not_import_transformers():
    """Issue 17 item 19: `%generate`'s module imported the batch scheduler, and with it transformers, at the kernel's
    start; like `%%chat` it now imports it on first use."""
    done = subprocess.run(
        [sys.executable, "-c", LOAD_THE_MAGICS], capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "transformers imported: False" in done.stdout, done.stdout + done.stderr[-2000:]
