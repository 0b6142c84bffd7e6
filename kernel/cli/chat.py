"""``shardbook chat``: chat with a sharded model in the terminal; rank 0 reads the input, every rank generates.

    shardbook chat --nproc 2 demo                    # the packaged demo config (`shardbook configs`)
    shardbook chat --nproc 2 /path/to/checkpoint     # a model directory: every setting at its default
    shardbook chat --nproc 2 configs/smollm2-135m.yaml --inference.max_new_tokens 64
    torchrun --nproc_per_node 2 -m shardbook chat configs/smollm2-135m.yaml
    shardbook chat configs/smollm2-135m.yaml        # one rank, in this process
    shardbook chat --slurm --nodes 2 --ntasks-per-node 8 --time 01:00:00 demo   # ranks on a Slurm allocation

Every rank runs ``python -m shardbook chat CONFIG ...``: each checks the config before joining
the job (a bad one ends every rank at once, with the same message), rank 0 loads the model on
every rank and runs the read-reply loop, the other ranks run the ordinary follower loop. Rank 0
sends each question with the whole conversation to every rank; the reply streams to stdout and
everything else (progress, status lines, command output, errors) goes to stderr, so
``echo QUESTION | shardbook chat ... > reply.txt`` keeps only the reply. ``exit``, ``quit`` or
the end of input stops every rank; ``/reset``, ``/system TEXT``, ``/think``, ``/no_think``,
``/template KEY=VALUE``, ``/history`` and ``/help`` are commands. ``--template-arg KEY=VALUE``
(repeatable, before or after CONFIG) passes a keyword to the chat template on every turn.

Ctrl-C: ``shardbook chat --nproc N`` starts torchrun through `launcher`, which relays Ctrl-C to
rank 0 alone: at the prompt it clears the line, during a reply it stops the reply on every rank
(the next question works), while the ranks start it ends the job. Under a bare ``torchrun -m
shardbook chat``, Ctrl-C ends the job: prefer ``shardbook chat --nproc N``. ``--slurm`` runs the
same command on every node of an allocation: rank 0 reads this terminal through srun and Ctrl-C
reaches it alone, so the chat behaves as under ``--nproc`` (``kernel/slurm/launch.py``).

The control-plane key: ``$SHARDBOOK_KEY`` or ``$SHARDBOOK_KEY_FILE`` when set (``--nproc`` sets a
fresh random one for each run). Otherwise, on one node, rank 0 writes a fresh key to a file only
this user can read, publishes the file's path (not the key) in torchrun's store, and deletes the
file once every follower has connected; anyone who can reach the store learns only the path. A job
over several nodes needs the same key on every node, set by hand.
"""

from __future__ import annotations

import argparse
import io
import logging
import os
import secrets
import signal
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from functools import partial
from typing import TYPE_CHECKING, Any

from shardbook.kernel.api.load import PreparedLoad, prepare_load
from shardbook.kernel.api.progress import step_text
from shardbook.kernel.cli.launcher import (
    config_argv,
    launch,
    launch_on_slurm,
    maybe_write_pid_file,
    split_launch_flags,
    take_flags,
)
from shardbook.kernel.ranks.failures import describe_failures
from shardbook.kernel.slurm.launch import REMOTE_TTY_ENV
from shardbook.kernel.slurm.options import add_slurm_flags
from shardbook.rankd.config.schema import ShardbookConfig
from shardbook.rankd.control import protocol
from shardbook.rankd.control.lifetime import die_with_parent
from shardbook.rankd.control.text import REPLACEMENT, replace_invalid
from shardbook.rankd.control.world import JobShape, World, init_world

if TYPE_CHECKING:
    from shardbook.kernel.api.chat import ChatModel
    from shardbook.kernel.api.conversation import Conversation
    from shardbook.kernel.ranks.runtime import Runtime

CONFIG_HELP = (
    "a YAML config (sections model, parallel, inference), a model directory (every setting at its default), "
    "or a packaged config by name: demo, qwen-8rank, glm-744b-npu (`shardbook configs` lists them); "
    "without one, give --model.model_name_or_path"
)
KEY_FILE_STORE_KEY = "shardbook/chat-key-file"
"""torchrun store key holding the path of rank 0's key file (one node, no key in the environment)."""
PROMPT = "> "
EXIT_WORDS = ("exit", "quit")
HELP = (
    "/reset         forget the conversation (the system prompt stays)\n"
    "/system TEXT   set the system prompt; /system alone removes it\n"
    "/think         turn the model's thinking on (the chat template's enable_thinking or thinking)\n"
    "/no_think      turn it off\n"
    "/template K=V  pass K=V to the chat template on every turn (V read as JSON when it parses);\n"
    "               /template alone clears them and the thinking switch\n"
    "/history       show the conversation\n"
    "/help          this list\n"
    "exit, quit or end of input (Ctrl-D) leaves; Ctrl-C stops the reply being written"
)


# --- command line ---------------------------------------------------------------------------
def add_chat_parser(sub) -> None:
    p = sub.add_parser(
        "chat",
        help="chat with a model sharded over N ranks, in the terminal",
        description=(
            "Chat with a model sharded over N ranks, in the terminal:\n\n" + __doc__.split("\n\n")[1] + "\n\n"
            "Prefer --nproc N to a bare torchrun: Ctrl-C then stops the reply, not the whole job."
        ),
        epilog="Commands while chatting:\n" + HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--nproc",
        type=int,
        help="ranks to start with torchrun (default: one rank in this process; omit under torchrun)",
    )
    add_template_flag(p)
    add_slurm_flags(p)
    p.add_argument("config", nargs="?", help=CONFIG_HELP)
    p.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="--section.key value pairs, e.g. --inference.max_new_tokens 64 (--nproc and Slurm's flags may come "
        "here too)",
    )
    p.set_defaults(run=run_chat)


def add_template_flag(parser: argparse.ArgumentParser, default: Any = None) -> None:
    parser.add_argument(
        "--template-arg",
        action="append",
        default=default,
        metavar="KEY=VALUE",
        help="a chat-template keyword for every turn (repeatable), VALUE read as JSON when it parses: "
        "--template-arg enable_thinking=false",
    )


def split_template_args(args: argparse.Namespace) -> dict[str, Any]:
    """``--template-arg`` given after CONFIG out of the config overrides; every one of them parsed (ValueError)."""
    from shardbook.kernel.api.conversation import parse_template_args

    take_flags(args, add_template_flag)
    args.template_arg = args.template_arg or []
    return parse_template_args(args.template_arg)


def run_chat(args: argparse.Namespace) -> int:
    """``--nproc N`` starts torchrun, ``--slurm`` an allocation; without either this process is one rank."""
    split_launch_flags(args)
    template_options = split_template_args(args)  # a bad one fails here, before any rank starts
    shape = JobShape.from_env()
    command = ["chat", *(f"--template-arg={text}" for text in args.template_arg), *config_argv(args), *args.overrides]
    if args.slurm:
        return launch_on_slurm(args, command, "shardbook-chat", interactive=True)
    if args.nproc is None:
        return run_rank(args, shape, then=partial(chat_in_terminal, template_options=template_options))
    if shape.under_torchrun:
        raise ValueError(
            "--nproc starts torchrun itself; under torchrun run `python -m shardbook chat CONFIG` without it"
        )
    return launch(args, command)


# --- every rank -----------------------------------------------------------------------------
def run_rank(args: argparse.Namespace, shape: JobShape, then=None, name: str = "shardbook chat") -> int:
    """Check the config, join the job, then chat (rank 0) or serve rank 0's commands (the others).

    ``then(runtime, config, terminal)`` is what rank 0 does once the model is loaded (default: chat).
    """
    from shardbook.rankd.__main__ import configure_logging

    configure_logging(shape.rank)
    logging.getLogger().setLevel(logging.WARNING)
    if shape.under_torchrun:
        die_with_parent()
    try:
        prepared = prepare_load(args.config, args.overrides, shape.world_size)
        check_key_source(shape)
        requested = None if prepared.config.parallel.device == "auto" else prepared.config.parallel.device
        world = init_world(requested, shape)
    except ValueError as e:
        if shape.rank == 0:
            raise
        if not shape.single_node:  # rank 0 reports the error of its own node
            raise ValueError(f"rank {shape.rank}: {e}") from e
        return leave_the_report_to_rank0()
    if shape.rank > 0:
        return run_follower_rank(world)
    return run_rank0(world, prepared, then or chat_in_terminal, name)


FOLLOWER_REPORT_WAIT_S = 30.0


def leave_the_report_to_rank0() -> int:
    """Exit status 2 for a follower that found the config bad, once rank 0 has had the time to say why.

    Every rank of one node checks the same config, so rank 0 finds the same error and prints it. torchrun stops
    every rank as soon as one exits; a follower that left at once could have rank 0 stopped before it printed, and
    the run would end with no word of the cause. So the follower waits to be stopped (torchrun does that when rank
    0 exits), at most FOLLOWER_REPORT_WAIT_S.
    """
    time.sleep(FOLLOWER_REPORT_WAIT_S)
    return 2


def check_key_source(shape: JobShape) -> None:
    if not shape.single_node and protocol.control_key() is None:
        raise ValueError(
            f"a chat over several nodes needs the same control-plane key on every node: set {protocol.KEY_ENV} "
            f"(e.g. to the output of `python -c 'import secrets; print(secrets.token_hex(32))'`) or "
            f"{protocol.KEY_FILE_ENV} on every node before starting torchrun"
        )


def run_follower_rank(world: World) -> int:
    from shardbook.rankd import commands  # noqa: F401  (fills the command table the follower dispatches from)
    from shardbook.rankd.control.follower import run_follower

    run_follower(world, protocol.make_session(follower_key(world)))
    return 0


def follower_key(world: World) -> bytes:
    """The key from the environment, else from the file rank 0 published in the store."""
    from shardbook.rankd.control.world import CONNECT_TIMEOUT_S

    found = protocol.control_key()
    if found is not None:
        return found[0]
    try:
        world.store.wait([KEY_FILE_STORE_KEY], timedelta(seconds=CONNECT_TIMEOUT_S))
    except RuntimeError as e:
        raise RuntimeError(
            f"rank {world.rank}: rank 0 did not publish the chat's key file within {CONNECT_TIMEOUT_S:.0f} s; "
            "does rank 0 run `python -m shardbook chat` with the same arguments? Check its output"
        ) from e
    return protocol.control_key(key_file=world.store.get(KEY_FILE_STORE_KEY).decode())[0]


@contextmanager
def control_key(world: World) -> Iterator[bytes | None]:
    """Rank 0's key: the environment's, else a fresh one in a private file the followers read (see above)."""
    found = protocol.control_key()
    if found is not None or world.world_size == 1:
        yield None if found is None else found[0]
        return
    key = secrets.token_hex(32).encode()
    fd, path = tempfile.mkstemp(prefix="shardbook-chat-", suffix=".key")  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        world.store.set(KEY_FILE_STORE_KEY, path)
        yield key
    finally:
        os.unlink(path)


# --- rank 0 ---------------------------------------------------------------------------------
@dataclass
class TerminalShell:
    """What the ``load`` command needs of rank 0's shell: a namespace for ``model`` and ``tokenizer``.

    There is no IPython here, so ``exec`` commands (``%%all`` cells) are not offered in the terminal.
    """

    user_ns: dict[str, Any] = field(default_factory=dict)


def run_rank0(world: World, prepared: PreparedLoad, then, name: str) -> int:
    from shardbook.kernel.ranks.pool import PoolError
    from shardbook.kernel.ranks.runtime import start_runtime

    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGUSR1, signal.default_int_handler)  # Ctrl-C of `chat --slurm` (kernel/slurm/launch.py)
    maybe_write_pid_file()
    terminal = Terminal(name)
    runtime = None
    try:
        with control_key(world) as key:
            runtime = start_runtime(TerminalShell(), key=key, world=world)
        if not load_model(runtime, prepared, terminal):
            return 1
        return then(runtime, prepared.config, terminal)
    except PoolError as e:
        terminal.error(str(e))
        return 1
    except KeyboardInterrupt:
        terminal.error("interrupted while the ranks started")
        return 130
    finally:
        if runtime is not None:
            runtime.close()


def chat_in_terminal(
    runtime: Runtime, config: ShardbookConfig, terminal: Terminal, template_options: dict[str, Any] | None = None
) -> int:
    from shardbook.kernel.api.chat import ChatModel
    from shardbook.kernel.api.conversation import Conversation

    conversation = Conversation(system_prompt=config.inference.system_prompt, template_options=template_options or {})
    terminal.info("/help lists the commands; exit leaves.")
    return TerminalChat(ChatModel(runtime), conversation, terminal).run()


def load_model(runtime: Runtime, prepared: PreparedLoad, terminal: Terminal) -> bool:
    """Load on every rank with a progress line; False (the failures shown) when any rank failed."""
    from shardbook.kernel.api.load import load_on_ranks

    config, model_path = prepared.config, prepared.model_path
    terminal.info(f"loading {config.model.model_name_or_path} on {runtime.world.world_size} rank(s)")
    terminal.info(f"settings from {prepared.source.description}")

    def on_output(rank: int, msg_type: str, payload: dict[str, Any]) -> None:
        if rank == 0 and msg_type == protocol.PROGRESS:
            terminal.progress(step_text(payload["step"], payload["done"], payload["total"]))

    try:
        outcome = load_on_ranks(runtime.pool, config, model_path, on_output, terminal.notice)
    except KeyboardInterrupt:
        outcome = None
    terminal.progress("")
    if outcome is None or not outcome.ok:
        terminal.error("loading failed: " + (describe_failures(outcome) if outcome else "interrupted"))
        return False
    s = outcome.replies[0]["value"]
    terminal.info(
        f"loaded {s['architecture']} ({s['num_parameters'] / 1e6:.1f}M parameters, {s['dtype']}, {s['device']}) "
        f"on {s['world_size']} rank(s) in {s['load_seconds']:.1f} s, decode layout {s['decode']}."
    )
    return True


class Terminal:
    """Questions from stdin, replies to stdout; progress, status lines, command output and errors to stderr."""

    def __init__(self, name: str = "shardbook chat"):
        self.name = name
        remote = os.environ.get(REMOTE_TTY_ENV, "").split(",")  # the user's terminal, behind srun's pipes
        self.interactive = sys.stdin.isatty() or "stdin" in remote
        self.styled = sys.stderr.isatty() or "stderr" in remote
        # the user's stdout and stderr are one terminal behind srun, which passes two pipes on out of order
        self.err = sys.stdout if {"stdout", "stderr"} <= set(remote) else sys.stderr
        self._reply_ends_line = True
        if isinstance(sys.stdin, io.TextIOWrapper):
            sys.stdin.reconfigure(errors="surrogateescape")  # bytes that are not UTF-8 reach read_line, not a crash
        if sys.stdin.isatty():
            import readline  # noqa: F401  (line editing and history for input())

    def read_line(self) -> str:
        """The next line, bytes that are not UTF-8 shown as U+FFFD (with a notice); EOFError at the end of input,
        KeyboardInterrupt on Ctrl-C."""
        if self.interactive:
            line = input(PROMPT)
        else:
            line = sys.stdin.readline()
            if not line:
                raise EOFError
        line, num_invalid = replace_invalid(line)
        if num_invalid:
            self.notice(
                f"this line is not valid UTF-8: {num_invalid} byte(s) read as U+FFFD ({REPLACEMENT}); "
                "send UTF-8 text (e.g. pipe it through `iconv -f latin1 -t utf-8`)"
            )
        return line

    def end_line(self) -> None:
        sys.stdout.write("\n")
        sys.stdout.flush()

    def write_reply(self, text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()
        if text:
            self._reply_ends_line = text.endswith("\n")

    def end_reply(self) -> None:
        if not self._reply_ends_line:
            self.write_reply("\n")

    def status(self, text: str) -> None:
        self._stderr(f"\x1b[2m[{text}]\x1b[0m" if self.styled else f"[{text}]")

    def info(self, text: str) -> None:
        self._stderr(text)

    def notice(self, text: str) -> None:
        self._stderr(f"{self.name}: {text}")

    def error(self, text: str) -> None:
        self._stderr(f"{self.name}: error: {text}")

    def progress(self, text: str) -> None:
        """One line rewritten in place on a terminal (empty text clears it); nothing elsewhere."""
        if self.styled:
            self.err.write(f"\r\x1b[K{text}")
            self.err.flush()

    def _stderr(self, text: str) -> None:
        self.err.write(text + "\n")
        self.err.flush()


class TerminalChat:
    """Rank 0's read-reply loop over one conversation."""

    def __init__(self, model: ChatModel, conversation: Conversation, terminal: Terminal):
        self.model = model
        self.conversation = conversation
        self.terminal = terminal

    def run(self) -> int:
        """Answer lines until ``exit``, ``quit`` or the end of input; Ctrl-C at the prompt clears the line."""
        while True:
            try:
                if not self.step():
                    return 0
            except KeyboardInterrupt:
                self.terminal.end_line()

    def step(self) -> bool:
        """Read and handle one line; False when the chat is over."""
        try:
            text = self.terminal.read_line().strip()
        except EOFError:
            if self.terminal.interactive:
                self.terminal.end_line()
            return False
        if text.lower() in EXIT_WORDS:
            return False
        if text.startswith("/"):
            self.run_command(text)
        elif text:
            self.reply(text)
        return True

    def run_command(self, text: str) -> None:
        name, _, rest = text.partition(" ")
        if name == "/reset":
            self.conversation.reset()
            self.terminal.info("(conversation cleared)")
        elif name == "/system":
            self.conversation.system_prompt = rest.strip() or None
            self.terminal.info(f"(system prompt set: {rest.strip()})" if rest.strip() else "(system prompt removed)")
        elif name in ("/think", "/no_think"):
            self.conversation.thinking = name == "/think"
            self.terminal.info(self.conversation.template_line())
        elif name == "/template":
            self.set_template_option(rest.strip())
        elif name == "/history":
            self.terminal.info(self.conversation.history_text())
        elif name == "/help":
            self.terminal.info(HELP)
        else:
            self.terminal.error(f"unknown command {name}; the commands are:\n{HELP}")

    def set_template_option(self, text: str) -> None:
        """``/template KEY=VALUE`` keeps one for every later turn; ``/template`` alone forgets them all."""
        from shardbook.kernel.api.conversation import parse_template_arg

        if not text:
            self.conversation.thinking, self.conversation.template_options = None, {}
        else:
            try:
                key, value = parse_template_arg(text, flag="/template")
            except ValueError as e:
                self.terminal.error(str(e))
                return
            self.conversation.template_options = {**self.conversation.template_options, key: value}
        self.terminal.info(self.conversation.template_line())

    def reply(self, text: str) -> None:
        """Stream the reply to ``text``; Ctrl-C meanwhile stops it on every rank and keeps what was written."""
        from shardbook.kernel.api.chat import ChatStream, GenerationFailed
        from shardbook.kernel.api.replies import ReplyParts, marked, request_format
        from shardbook.kernel.ranks.foreground import sigint_calls

        try:
            request = self.model.build_request(
                self.conversation.request_messages(text),
                system_prompt=None,
                thinking=self.conversation.thinking,
                template_options=self.conversation.template_options,
            )
            parts = ReplyParts(request_format(self.model.runtime, request))  # renders the prompt: the template's errors
        except ValueError as e:
            self.terminal.error(str(e))
            return
        notice = self.model.template_notice(request.template_options)
        if notice:
            self.terminal.notice(notice)
        stream = ChatStream(self.model.runtime, request, on_notice=self.terminal.notice, start=False)
        with sigint_calls(stream.stop):
            stream.start()
            try:
                for chunk in stream:
                    self.terminal.write_reply(marked(parts.feed(chunk), parts))
                self.terminal.write_reply(marked(parts.finish(), parts))
            except (GenerationFailed, TimeoutError) as e:
                self.terminal.end_reply()
                why = describe_failures(e.outcome) if isinstance(e, GenerationFailed) else str(e)
                self.terminal.error(f"no reply: {why}")
                return
            self.terminal.end_reply()
            response = parts.apart(stream.response)
            self.terminal.status(response.status_line())
            self.conversation.add_turn(text, response.text, response.finish_reason, response.reasoning)
