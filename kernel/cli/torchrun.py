"""torchrun for ``shardbook chat/serve --nproc N``, without its ChildFailedError traceback.

A rank that fails (a model that does not load) has already said why, once, on rank 0's
stderr, and exits non-zero; torchrun would then print a Python traceback and a box of the
same failure. Here that exception ends torchrun quietly with the rank's exit code; a rank
killed by a signal (which could not say why) gets one line naming it.
"""

from __future__ import annotations

import logging
import signal
import sys


def main(argv: list[str]) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # its per-rank failure lines
    try:
        torchrun(argv)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode < 0:
            name = signal.Signals(-failure.exitcode).name
            print(f"shardbook: rank {rank} was ended by {name}", file=sys.stderr)
            return 128 - failure.exitcode
        return failure.exitcode or 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
