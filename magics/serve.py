"""``%serve``: the loaded model behind an OpenAI-compatible HTTP endpoint, served from inside the kernel."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments

from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.kernel.server.parser_help import REASONING_PARSER_HELP, TOOL_CALL_PARSER_HELP
from shardbook.magics.arguments import parse_line


@magics_class
class ServeMagics(Magics):
    """Serve the loaded model to OpenAI clients."""

    @magic_arguments()
    @argument("--port", type=int, default=None, help="port to listen on (default 8000; 0 picks a free one)")
    @argument("--host", default="127.0.0.1", help="address to listen on (default loopback; others need an API key)")
    @argument("--api-key", help="key clients must send as 'Authorization: Bearer KEY'")
    @argument("--api-key-file", help="file whose first line is the API key")
    @argument(
        "--max-waiting",
        type=int,
        help="requests that may wait beyond the running batch before 429 (default: as many as the batch holds, at "
        "least 32; 16 for replies that take turns)",
    )
    @argument(
        "--no-batch",
        action="store_true",
        help="chat completions take turns through transformers' generate instead of decoding together",
    )
    @argument("--tool-call-parser", metavar="NAME", help=TOOL_CALL_PARSER_HELP)
    @argument("--reasoning-parser", metavar="NAME", help=REASONING_PARSER_HELP)
    @argument(
        "--allowed-host",
        action="append",
        metavar="NAME",
        help="a name clients may reach the server by besides localhost and --host (a reverse proxy's or tunnel's; "
        "repeatable; * allows any): requests naming another Host are refused (DNS rebinding)",
    )
    @argument(
        "--allowed-origin",
        action="append",
        metavar="ORIGIN",
        help="a web page's origin (https://app.example.org:8443) whose browser requests are answered, with CORS "
        "headers (repeatable; * allows any); requests from other pages are refused",
    )
    @argument("--stop", action="store_true", help="stop the server")
    @argument("--status", action="store_true", help="show the URL, the queue, requests served and errors")
    @line_magic("serve")
    def serve(self, line: str):
        """Serve the model loaded by %load_sharded over an OpenAI-compatible HTTP API. Example::

            %serve --port 8000
            # then, anywhere on this machine:
            # OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none").chat.completions.create(...)

        Concurrent requests and %%chat cells decode together in one continuous batch (up to
        ``inference.max_batch_sequences``, sized from the KV budget by default; ``--max-waiting`` more wait,
        then 429); the stop button stops
        the replies in flight and the server keeps running. ``%serve --status`` and
        ``%serve --stop``. Loading another model switches what is served.
        """
        from shardbook.kernel.server.server import Server
        from shardbook.kernel.server.state import DEFAULT_PORT, ServeOptions, read_api_key

        args = parse_line(self.serve, line)
        try:
            runtime = get_runtime(self.shell)
        except PoolError as e:
            raise UsageError(str(e)) from e
        server = runtime.server
        if args.stop or args.status:
            if server is None:
                print("not serving; `%serve` starts a server")
            elif args.stop:
                server.stop()
                print(f"stopped serving at {server.url} ({server.stats.served} requests served)")
            else:
                print(server.status_text())
            return
        if server is not None:
            raise UsageError(f"already serving at {server.url}; `%serve --stop` first to change its settings")
        if args.api_key and args.api_key_file:
            raise UsageError("give either --api-key or --api-key-file, not both")
        try:
            key = read_api_key(args.api_key, args.api_key_file)
            port = DEFAULT_PORT if args.port is None else args.port
            options = ServeOptions(
                host=args.host,
                port=port,
                api_key=key,
                max_waiting=args.max_waiting,
                batch=not args.no_batch,
                tool_call_parser=args.tool_call_parser,
                reasoning_parser=args.reasoning_parser,
                allowed_hosts=tuple(args.allowed_host or ()),
                allowed_origins=tuple(args.allowed_origin or ()),
            )
            server = Server(runtime, options).start()
        except ValueError as e:
            raise UsageError(str(e)) from e
        model = server.model_id() or "(no model loaded yet: %load_sharded one)"
        print(f"serving {model} at {server.url} (OpenAI chat completions); `%serve --stop` stops it")
        print(f"batch: {server.batch_text()}")
