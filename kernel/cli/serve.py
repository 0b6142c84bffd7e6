"""``shardbook serve``: the OpenAI-compatible endpoint from a terminal, on ranks started with torchrun.

    shardbook serve --nproc 2 demo --port 8000
    shardbook serve --nproc 2 /path/to/checkpoint --parallel.decode tp
    shardbook serve --nproc 2 configs/smollm2-135m.yaml --port 8000
    shardbook serve --nproc 2 configs/smollm2-135m.yaml --host 0.0.0.0 --api-key-file ~/.shardbook/api.key
    shardbook serve --slurm --nodes 2 --ntasks-per-node 8 --time 01:00:00 configs/glm-744b-npu.yaml

Every rank runs ``python -m shardbook serve ...``, as for ``shardbook chat`` (same launcher,
same Ctrl-C relay): rank 0 loads the model on every rank and serves it until Ctrl-C or SIGTERM,
then stops listening, stops the reply in flight on every rank (its client gets what was
generated, ``finish_reason: "length"``), tells the followers to leave and exits 0. The API key
reaches the ranks through ``SHARDBOOK_API_KEY``, never their command line.
"""

from __future__ import annotations

import argparse
import os
import signal
import threading
from functools import partial

from shardbook.kernel.cli.chat import CONFIG_HELP, Terminal, run_rank
from shardbook.kernel.cli.launcher import config_argv, launch, launch_on_slurm, split_launch_flags, take_flags
from shardbook.kernel.ranks.runtime import Runtime
from shardbook.kernel.server.parser_help import REASONING_PARSER_HELP, TOOL_CALL_PARSER_HELP
from shardbook.kernel.server.state import DEFAULT_PORT, ServeOptions, read_api_key
from shardbook.kernel.slurm.options import add_slurm_flags
from shardbook.rankd.config.schema import ShardbookConfig
from shardbook.rankd.control.world import JobShape

API_KEY_ENV = "SHARDBOOK_API_KEY"


def add_serve_flags(parser: argparse.ArgumentParser, default=None) -> None:
    parser.add_argument("--port", type=int, default=default or DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    parser.add_argument(
        "--host", default=default or "127.0.0.1", help="address (default loopback; others need an API key)"
    )
    parser.add_argument(
        "--api-key", default=default, help=f"key clients send as 'Authorization: Bearer KEY' (or ${API_KEY_ENV})"
    )
    parser.add_argument("--api-key-file", default=default, help="file whose first line is the API key")
    parser.add_argument(
        "--max-waiting",
        type=int,
        default=default,
        help="requests that may wait beyond the running batch before 429 (default: as many as the batch holds, at "
        "least 32; 16 for replies that take turns)",
    )
    parser.add_argument(
        "--no-batch",
        action="store_true",
        default=default or False,
        help="chat completions take turns through transformers' generate instead of decoding together",
    )
    parser.add_argument("--tool-call-parser", default=default, metavar="NAME", help=TOOL_CALL_PARSER_HELP)
    parser.add_argument("--reasoning-parser", default=default, metavar="NAME", help=REASONING_PARSER_HELP)
    parser.add_argument(
        "--allowed-host",
        action="append",
        default=default,
        metavar="NAME",
        help="a name clients may reach the server by besides localhost and --host (a reverse proxy's or "
        "tunnel's; repeatable; * allows any): requests naming another Host are refused (DNS rebinding)",
    )
    parser.add_argument(
        "--allowed-origin",
        action="append",
        default=default,
        metavar="ORIGIN",
        help="a web page's origin (https://app.example.org:8443) whose browser requests are answered, with "
        "CORS headers (repeatable; * allows any); requests from other pages are refused",
    )


def add_serve_parser(sub) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model sharded over N ranks over an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[2],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--nproc", type=int, help="ranks to start with torchrun (default: one rank in this process)")
    add_serve_flags(p)
    add_slurm_flags(p)
    p.add_argument("config", nargs="?", help=CONFIG_HELP)
    p.add_argument(
        "overrides",
        nargs=argparse.REMAINDER,
        help="--section.key value pairs; serve flags, --nproc and Slurm's may come here too",
    )
    p.set_defaults(run=run_serve)


def split_flags(args: argparse.Namespace) -> None:
    """Serve flags given after CONFIG (``shardbook serve CONFIG --port 8001``) out of the config overrides, and the
    launch flags (``--nproc``, Slurm's)."""
    split_launch_flags(args)
    take_flags(args, partial(add_serve_flags, default=argparse.SUPPRESS))


def serve_options(args: argparse.Namespace) -> ServeOptions:
    """Checked options; ValueError (before any rank starts) names what to fix."""
    if args.api_key and args.api_key_file:
        raise ValueError("give either --api-key or --api-key-file, not both")
    key = read_api_key(args.api_key, args.api_key_file) or os.environ.get(API_KEY_ENV) or None
    options = ServeOptions(
        host=args.host,
        port=args.port,
        api_key=key,
        max_waiting=args.max_waiting,
        batch=not args.no_batch,
        tool_call_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser,
        allowed_hosts=tuple(args.allowed_host or ()),
        allowed_origins=tuple(args.allowed_origin or ()),
    )
    options.check()
    return options


def run_serve(args: argparse.Namespace) -> int:
    split_flags(args)
    options = serve_options(args)
    shape = JobShape.from_env()
    if args.nproc is None and not args.slurm:
        return run_rank(args, shape, then=partial(serve_until_stopped, options), name="shardbook serve")
    if shape.under_torchrun:
        raise ValueError(
            "--nproc starts torchrun itself; under torchrun run `python -m shardbook serve CONFIG` without it"
        )
    if options.api_key:
        os.environ[API_KEY_ENV] = options.api_key  # the ranks' environment, not their argv
    flags = ["--host", options.host, "--port", str(options.port)]
    flags += ["--max-waiting", str(args.max_waiting)] if args.max_waiting is not None else []
    flags += ["--no-batch"] if args.no_batch else []
    flags += [f"--tool-call-parser={options.tool_call_parser}"] if options.tool_call_parser else []
    flags += [f"--reasoning-parser={options.reasoning_parser}"] if options.reasoning_parser else []
    flags += [f"--allowed-host={name}" for name in options.allowed_hosts]
    flags += [f"--allowed-origin={origin}" for origin in options.allowed_origins]
    command = ["serve", *flags, *config_argv(args), *args.overrides]
    if args.slurm:  # the same ranks on an allocation; rank 0 (the server) on its first node
        return launch_on_slurm(args, command, "shardbook-serve")
    return launch(args, command, graceful_term=True)


def serve_until_stopped(options: ServeOptions, runtime: Runtime, config: ShardbookConfig, terminal: Terminal) -> int:
    """Rank 0, model loaded: serve until SIGINT or SIGTERM, then stop the reply in flight and return."""
    from shardbook.kernel.server.server import Server

    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda signum, frame: stop.set())
    try:
        server = Server(runtime, options).start()
    except ValueError as e:
        terminal.error(str(e))
        return 1
    terminal.info(f"serving {server.model_id()} at {server.url} (OpenAI chat completions); Ctrl-C stops")
    terminal.info(f"batch: {server.batch_text()}")
    while not stop.wait(0.5):
        pass
    terminal.info("stopping: the reply in flight is stopped on every rank")
    server.stop()
    terminal.info(f"stopped ({server.stats.served} requests served, {server.stats.errors} errors)")
    return 0
