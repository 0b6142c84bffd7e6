"""The process every rank of a shardbook kernel starts: rank 0 becomes the IPython kernel.

The kernelspec's argv is ``python -m torch.distributed.run ... -m shardbook.kernel -f CONN``;
every rank gets that argv, so this entry point splits them: rank 0 runs ipykernel's
``IPKernelApp`` with the shardbook magics loaded (the magics start the pool), every other rank
runs the follower loop and reads the same connection file for the control-plane key.
"""

from __future__ import annotations

import sys

from shardbook.rankd.lifetime import die_with_parent
from shardbook.rankd.world import JobShape


def connection_file_from(argv: list[str]) -> str | None:
    for i, arg in enumerate(argv):
        if arg == "-f" and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith("--f=") or arg.startswith("--IPKernelApp.connection_file="):
            return arg.split("=", 1)[1]
    return None


def launch_kernel(argv: list[str]) -> None:
    """Rank 0: an ipykernel whose shell loads ``shardbook.magics`` (which connects the pool)."""
    from ipykernel.kernelapp import IPKernelApp

    die_with_parent()
    IPKernelApp.launch_instance(argv=[*argv, "--ext=shardbook.magics"])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if JobShape.from_env().rank == 0:
        launch_kernel(argv)
        return 0
    from shardbook.rankd.__main__ import follower_main

    return follower_main(connection_file=connection_file_from(argv))
