"""shardbook's IPython surface: ``%load_ext shardbook.magics`` (the shardbook kernel loads it itself)."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def load_ipython_extension(shell) -> None:
    """Register the magics, then start the runtime (join the job, connect every follower).

    A start-up failure is logged and kept: each magic then raises it at once as a UsageError,
    so the kernel stays usable and the cause shows in the notebook rather than only in a server
    log; every frontend that connects also gets it on IOPub.
    """
    from shardbook.rankd.control.startup_marks import mark

    mark("kernel app set up")
    from shardbook.kernel.ranks.runtime import get_runtime
    from shardbook.magics.cells import RankMagics
    from shardbook.magics.chat import ChatMagics
    from shardbook.magics.errors import RankError, show_rank_error
    from shardbook.magics.generate import GenerateMagics
    from shardbook.magics.inspection import InspectionMagics
    from shardbook.magics.loading import LoadMagics
    from shardbook.magics.serve import ServeMagics

    mark("magics imported")
    shell.register_magics(RankMagics)
    shell.register_magics(LoadMagics)
    shell.register_magics(ChatMagics)
    shell.register_magics(GenerateMagics)
    shell.register_magics(ServeMagics)
    shell.register_magics(InspectionMagics)
    shell.set_custom_exc((RankError,), show_rank_error)
    try:
        runtime = get_runtime(shell)
    except Exception as e:
        log.exception("shardbook: the rank pool failed to start; magics will report the error")
        kernel = getattr(shell, "kernel", None)
        if kernel is not None and hasattr(kernel, "shell_handlers"):
            from shardbook.magics.startup import announce_on_connect, show_at_start

            announce_on_connect(kernel, str(e))
            show_at_start(shell, str(e))
    else:
        mark("ranks connected")
        from shardbook.magics.startup import maybe_show_slurm_note
        from shardbook.rankd.control.world import slurm_note

        maybe_show_slurm_note(shell, slurm_note())
        from shardbook.magics.interrupts import install_interrupt_hook

        install_interrupt_hook(shell, runtime.generation_queue)
