"""``--nproc N`` for the terminal commands: start the ranks' launcher in a session of its own, relay Ctrl-C to rank 0.

(``--slurm`` goes to `launch_on_slurm`: the same ranks in an allocation, see ``kernel/slurm/launch.py``.)

The launcher (``localrun``, which does torchrun's one-node job) starts every rank in a session of
its own, so a terminal's Ctrl-C reaches the launcher alone, which ends the whole job. ``shardbook
chat --nproc N`` (and ``shardbook serve``) therefore start the launcher in a new session and relay
Ctrl-C to rank 0 only, which decides what it means (clear the prompt, stop the reply). While the
ranks start, before rank 0 has written its pid, Ctrl-C ends the job. Rank 0 has no controlling
terminal there yet reads it as usual (a terminal checks job control only for the sessions it controls).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardbook.kernel.api.load import prepare_load
from shardbook.kernel.cli.kernelspec import Layout
from shardbook.kernel.slurm.launch import run_in_allocation
from shardbook.kernel.slurm.options import add_slurm_flags, options_from_args
from shardbook.rankd.control import protocol
from shardbook.rankd.control.lifetime import die_with_parent

PID_FILE_ENV = "SHARDBOOK_CHAT_PIDFILE"
"""Set by ``--nproc``: the file rank 0 writes its pid to, so that Ctrl-C can be relayed to it."""


def launch(args: argparse.Namespace, command: list[str] | None = None, graceful_term: bool = False) -> int:
    """Start the launcher in a session of its own, relay Ctrl-C to rank 0, and return the launcher's exit code.

    Every rank runs ``python -m shardbook COMMAND`` (default: ``chat CONFIG OVERRIDES``); with
    ``graceful_term`` SIGTERM is relayed to rank 0 as well, which then ends the job itself.
    """
    layout = Layout(args.nproc)
    prepare_load(args.config, args.overrides, layout.nproc)  # a bad config fails here, before any rank starts
    with tempfile.TemporaryDirectory(prefix="shardbook-chat-") as tmp:
        pid_file = Path(tmp) / "rank0.pid"
        env = {**os.environ, protocol.KEY_ENV: secrets.token_hex(32), PID_FILE_ENV: str(pid_file)}
        env.pop(protocol.KEY_FILE_ENV, None)  # it would take precedence over the fresh key
        argv = [
            sys.executable,
            *layout.launcher_args(),  # one node: localrun, which names a rank ended by a signal in one line
            "-m",
            "shardbook",
            *(command or ["chat", *config_argv(args), *args.overrides]),
        ]
        torchrun = subprocess.Popen(argv, env=env, start_new_session=True, preexec_fn=die_with_parent)
        with relayed_signals(torchrun, pid_file, graceful_term):
            code = torchrun.wait()
    return 128 - code if code < 0 else code  # killed by a signal: the shell's convention


def launch_on_slurm(args: argparse.Namespace, command: list[str], job_name: str, interactive: bool = False) -> int:
    """``--slurm``: every rank runs ``python -m shardbook COMMAND`` on an allocation, rank 0 on its first node."""
    if args.nproc is not None:
        raise ValueError("--slurm starts --ntasks-per-node ranks on each node; leave out --nproc")
    slurm = options_from_args(args, {})
    prepare_load(args.config, args.overrides, slurm.nodes * slurm.ntasks_per_node)  # a bad config fails here
    return run_in_allocation(slurm, ["-m", "shardbook", *command], job_name, interactive)


def split_launch_flags(args: argparse.Namespace) -> None:
    """``--nproc`` and the Slurm flags given after CONFIG (``shardbook serve DIR --nproc 2``) out of the config
    overrides, as if given before it (the overrides only take ``--section.key``, and would refuse them)."""
    take_flags(args, _add_launch_flags)


def _add_launch_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--nproc", type=int)
    add_slurm_flags(parser)


def take_flags(args: argparse.Namespace, add_flags: Callable[[argparse.ArgumentParser], None]) -> None:
    """The flags `add_flags` declares, given after CONFIG, out of the config overrides (`args.overrides`) and into
    `args`, as if given before it: a repeatable flag's values add to those given before CONFIG, and a flag not
    given after it keeps its value."""
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, argument_default=argparse.SUPPRESS)
    add_flags(parser)
    unset = vars(parser.parse_args([]))  # the flags with a default of their own
    flags, args.overrides = parser.parse_known_args(args.overrides)
    for name, value in vars(flags).items():
        if name in unset and value == unset[name]:
            continue
        if isinstance(value, list):  # repeatable: those before CONFIG count too
            value = (getattr(args, name, None) or []) + value
        setattr(args, name, value)


def config_argv(args: argparse.Namespace) -> list[str]:
    """CONFIG as the ranks' command line passes it on: absent when only overrides name the model."""
    return [] if args.config is None else [args.config]


@contextmanager
def relayed_signals(torchrun: subprocess.Popen, pid_file: Path, graceful_term: bool = False) -> Iterator[None]:
    """Ctrl-C goes to rank 0 (or ends the job while it starts);
    SIGTERM (unless ``graceful_term``) and SIGHUP end the job."""

    def relay(signum, frame) -> None:
        pid = read_pid(pid_file)
        if pid is None:
            print("shardbook: interrupted while the ranks start; stopping them", file=sys.stderr)
            torchrun.terminate()
            return
        try:
            os.kill(pid, signum)
        except ProcessLookupError:  # rank 0 has already left; the launcher is ending the others
            pass

    def stop(signum, frame) -> None:
        torchrun.terminate()

    handlers = {signal.SIGINT: relay, signal.SIGTERM: relay if graceful_term else stop, signal.SIGHUP: stop}
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def read_pid(pid_file: Path) -> int | None:
    try:
        return int(pid_file.read_text())
    except (FileNotFoundError, ValueError):
        return None


def maybe_write_pid_file() -> None:
    """Under ``--nproc``: tell the launcher where to send Ctrl-C (written whole, then renamed)."""
    path = os.environ.get(PID_FILE_ENV)
    if path:
        partial = Path(f"{path}.partial")
        partial.write_text(str(os.getpid()))
        partial.replace(path)
