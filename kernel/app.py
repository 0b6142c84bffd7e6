"""The process every rank of a shardbook kernel starts: rank 0 becomes the IPython kernel.

The kernelspec's argv is ``python -m torch.distributed.run ... -m shardbook.kernel -f CONN``;
every rank gets that argv, so this entry point splits them: rank 0 runs ipykernel's
``IPKernelApp`` with the shardbook magics loaded (the magics start the pool), every other rank
runs the follower loop and reads the same connection file for the control-plane key.
"""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn

from shardbook.rankd.control.lifetime import die_with_parent, exit_with_launcher
from shardbook.rankd.control.startup_marks import mark, mark_process_start
from shardbook.rankd.control.world import JobShape


def connection_file_from(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "-f" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(("--f=", "--IPKernelApp.connection_file=")):
            return arg.split("=", 1)[1]
    return None


def launch_kernel(argv: list[str]) -> None:
    """Rank 0: an ipykernel whose shell loads ``shardbook.magics`` (which connects the pool)."""
    from ipykernel.kernelapp import IPKernelApp

    mark("ipykernel imported")

    die_with_parent()
    exit_with_launcher()
    try:
        IPKernelApp.launch_instance(argv=[*argv, "--ext=shardbook.magics"])
    except SystemExit as e:
        if e.code not in (None, 0):
            raise
    exit_without_teardown()


def exit_without_teardown() -> NoReturn:
    """End rank 0 after a clean kernel shutdown, skipping the interpreter's teardown.

    With torch and transformers imported, CPython's teardown (freeing every module and their
    objects) took 0.6-1.3 s here. torchrun needs about 1 s more after its last worker exits, and
    jupyter_client sends SIGTERM 2.5 s after its shutdown request: a kernel that took 2.5 s to end
    was killed, and torchrun logged the SIGTERM as a failure. The exit handlers (the pool, the
    connection file, IPython's history, logging) still run first; only the teardown is skipped.
    """
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            stream.flush()
        except (AttributeError, ValueError, OSError):  # closed or replaced at shutdown
            pass
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    mark_process_start()
    mark("python up")
    if JobShape.from_env().rank == 0:
        launch_kernel(argv)
        return 0
    from shardbook.rankd.__main__ import follower_main

    return follower_main(connection_file=connection_file_from(argv))
