"""``python -m shardbook.rankd``: follower ranks of a shardbook job (every rank but rank 0).

On the kernel's own node the kernel's argv starts followers too (``-m shardbook.kernel`` hands
ranks > 0 to :func:`follower_main`); on the other nodes of a multi-node job people run::

    torchrun --nnodes 2 --node_rank 1 --master_addr HOST --master_port PORT \\
             --nproc_per_node 8 -m shardbook.rankd --key-file ~/.shardbook/job.key
"""

from __future__ import annotations

import argparse
import logging
import sys

from shardbook.rankd.control import protocol
from shardbook.rankd.control.lifetime import die_with_parent, exit_with_launcher
from shardbook.rankd.control.startup_marks import mark
from shardbook.rankd.control.world import JobShape, StartupAbandoned


def control_key(connection_file: str | None, key_file: str | None) -> tuple[bytes, str]:
    """The HMAC key: an explicit key file, else the environment, else the connection file."""
    found = protocol.control_key(key_file=key_file, connection_file=connection_file)
    if found is not None:
        return found
    raise ValueError(
        f"no control-plane key: pass --key-file (a copy of the kernel's key file) or set "
        f"{protocol.KEY_FILE_ENV} / {protocol.KEY_ENV}"
    )


def configure_logging(rank: int) -> None:
    logging.basicConfig(
        level=logging.INFO, format=f"[shardbook rank {rank}] %(levelname)s %(name)s: %(message)s", stream=sys.__stderr__
    )


def follower_main(connection_file: str | None = None, key_file: str | None = None) -> int:
    shape = JobShape.from_env()
    configure_logging(shape.rank)
    if shape.rank == 0:
        print(
            "shardbook.rankd runs the follower ranks only; rank 0 must be the kernel "
            "(python -m shardbook.kernel on node_rank 0). Start this with --node_rank 1 or higher.",
            file=sys.stderr,
        )
        return 2
    die_with_parent()
    exit_with_launcher()
    try:
        from shardbook.rankd import commands  # noqa: F401  (fills the command table the follower dispatches from)
        from shardbook.rankd.control.follower import run_follower

        # The control session (jupyter_client's, 82 modules) is made before joining the process group, while
        # rank 0 still imports torch under ipykernel: after the rendezvous rank 0 waits for this rank's hello.
        session = protocol.make_session(*control_key(connection_file, key_file))
        mark("imported")
    except Exception as e:
        return startup_failed(shape, e)
    from shardbook.rankd.control.world import init_world

    try:
        world = init_world(shape=shape)
        mark("process group up")
    except StartupAbandoned as e:  # exit status 0: torchrun must not end the kernel, which reports the failure
        logging.getLogger(__name__).error("rank %d leaves: %s", shape.rank, e)
        return 0
    run_follower(world, session)
    return 0


def startup_failed(shape: JobShape, error: Exception) -> int:
    """This rank failed before it joined the job (an import, the key): say so in its log and tell rank 0.

    The line names the rank and its error in the log people read (the Jupyter server's, for a
    kernel). Rank 0 is told by a note on its node, which needs no torch (this failure may be torch's
    own import), or else through the job's store. Once rank 0 knows, it reports the failure in the
    kernel, and this rank exits with status 0: a failed exit would make the launcher end the kernel
    before it could say why. When rank 0 cannot be told, the exit status is 1 (the launcher then
    ends the job).
    """
    text = f"{type(error).__name__}: {error}"
    logging.getLogger(__name__).error("rank %d failed at start-up: %s", shape.rank, text, exc_info=error)
    from shardbook.rankd.control.world import report_startup_failure

    return 0 if report_startup_failure(shape, text) else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m shardbook.rankd", description=__doc__.splitlines()[0])
    parser.add_argument("--key-file", help="file holding the kernel's control-plane key")
    parser.add_argument("-f", "--connection-file", help="the kernel's Jupyter connection file (same node only)")
    args = parser.parse_args(argv)
    return follower_main(args.connection_file, args.key_file)


if __name__ == "__main__":
    sys.exit(main())
