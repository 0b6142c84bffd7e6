"""``%%chat``: multi-turn chat with the sharded model, streamed live; ``%chat`` manages the conversation."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments
from IPython.display import display

from shardbook.kernel.api.conversation import Conversation, parse_template_args
from shardbook.kernel.api.reasoning import Split
from shardbook.kernel.api.tools import MAX_TOOL_STEPS
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.magics.arguments import parse_line
from shardbook.magics.errors import raise_for_outcome
from shardbook.magics.relay import RankRelay, frontend_for
from shardbook.magics.views.chat_view import ScoresView, TextChatView, WidgetChatView, show_step
from shardbook.magics.views.progress import widgets_available


def generation_options(fn):
    """Sampling flags; unset ones fall back to the loaded config's ``inference`` section."""
    for flag, kind, text in reversed(
        [
            ("--max-new-tokens", int, "most tokens to generate"),
            ("--temperature", float, "sampling temperature"),
            ("--top-p", float, "nucleus sampling probability mass"),
            ("--top-k", int, "sample among the K most likely tokens"),
            ("--repetition-penalty", float, "penalty for repeated tokens (1.0 = none)"),
            ("--seed", int, "seed for sampling (rank 0 picks one if unset; every rank uses it)"),
        ]
    ):
        fn = argument(flag, type=kind, default=None, help=text)(fn)
    fn = argument("--do-sample", action="store_true", default=None, help="sample instead of greedy decoding")(fn)
    return fn


def template_flags(fn):
    """Chat-template options: for the cell with ``%%chat``, kept for the conversation with ``%chat``."""
    flags = [
        argument(
            "--thinking",
            dest="thinking",
            action="store_const",
            const=True,
            default=None,
            help="turn the model's thinking on (the template's enable_thinking or thinking switch)",
        ),
        argument("--no-thinking", dest="thinking", action="store_const", const=False, help="turn thinking off"),
        argument(
            "--template-arg",
            action="append",
            metavar="KEY=VALUE",
            help="a chat-template keyword (repeatable); VALUE is read as JSON when it parses "
            '(false, 0.5, "low"), else as text: --template-arg reasoning_effort=low',
        ),
        argument(
            "--clear-template-args",
            action="store_true",
            help="(line magic) forget the conversation's thinking switch and template args",
        ),
    ]
    for flag in reversed(flags):
        fn = flag(fn)
    return fn


@magics_class
class ChatMagics(Magics):
    """Talk to the model loaded with %load_sharded."""

    def __init__(self, shell):
        super().__init__(shell)
        self.conversation = Conversation()

    @magic_arguments()
    @argument_group("reply")
    @generation_options
    @argument(
        "--scores",
        action="store_true",
        help="record each token's probability and top alternatives (_chat.scores) and show them",
    )
    @argument(
        "--output", choices=("widget", "text"), default=None, help="live widget (default in notebooks) or plain text"
    )
    @argument_group("chat template")
    @template_flags
    @argument_group("tools")
    @argument(
        "--tools",
        metavar="NAME",
        help="let the model call the functions of the list NAME (defined in the notebook): each call runs here, "
        "its result goes back to the model, until it answers; every call is shown and kept in _chat.steps",
    )
    @argument(
        "--max-tool-steps",
        type=int,
        default=MAX_TOOL_STEPS,
        metavar="N",
        help=f"with --tools: stop after N tool calls (default {MAX_TOOL_STEPS})",
    )
    @argument_group("conversation")
    @argument("--new", action="store_true", help="start a new conversation with this message")
    @argument(
        "--no-batch",
        action="store_true",
        help="reply alone through transformers' generate (waits its turn) instead of joining the running batch",
    )
    @argument("--system", metavar="TEXT", help="set the system prompt (kept for later turns)")
    @argument("--reset", action="store_true", help="(line magic) forget the conversation")
    @argument("--history", action="store_true", help="(line magic) show the conversation")
    @argument("--save", metavar="FILE", help="(line magic) save the conversation as JSON")
    @argument("--load", metavar="FILE", help="(line magic) load a conversation saved with --save")
    @line_cell_magic("chat")
    def chat(self, line: str, cell: str | None = None):
        """Chat with the sharded model; the cell is your message and the reply streams live. Example::

            %load_sharded configs/smollm2-135m.yaml
            %%chat --max-new-tokens 64
            What is the capital of France?

        Later ``%%chat`` cells continue the conversation (``--new`` starts over). The line magic
        manages it: ``%chat --history``, ``%chat --reset``, ``%chat --system "Be brief."``,
        ``%chat --save chat.json``, ``%chat --load chat.json``.

        Chat-template options: ``%%chat --no-thinking`` (or ``--template-arg reasoning_effort=low``) for one
        cell; ``%chat --no-thinking`` / ``%chat --template-arg KEY=VALUE`` keep them for the conversation,
        ``%chat --clear-template-args`` forgets them.

        Tools: ``%%chat --tools tools`` with ``tools = [get_weather]`` (functions with type hints and a docstring)
        lets the model call them; each call runs here and is shown, ``_chat.steps`` keeps them.
        """
        args = parse_line(self.chat, line)
        try:
            args.template_options = parse_template_args(args.template_arg)
        except ValueError as e:
            raise UsageError(str(e)) from e
        if cell is not None and args.clear_template_args:
            raise UsageError("--clear-template-args is for the line magic: `%chat --clear-template-args`")
        if args.system is not None:
            self.conversation.system_prompt = args.system or None
        if cell is None:
            return self._manage(args)
        if not cell.strip():
            raise UsageError("%%chat needs a message in the cell body, e.g.\n%%chat\nWhat is the capital of France?")
        if args.new:
            self.conversation.reset()
        return self._reply(cell.strip(), args)

    def _manage(self, args):
        try:
            if args.load:
                self.conversation = Conversation.load(args.load)
            if args.reset:
                self.conversation.reset()
            if args.save:
                print(f"saved {len(self.conversation.turns)} messages to {self.conversation.save(args.save)}")
        except ValueError as e:  # a file that cannot be read, parsed or written: one line, not a traceback
            raise UsageError(str(e)) from e
        template_change = args.clear_template_args or args.thinking is not None or bool(args.template_options)
        if template_change:
            self._keep_template_options(args)
        if args.history or not (args.load or args.reset or args.save or args.system is not None or template_change):
            print(self.conversation.history_text())

    def _keep_template_options(self, args) -> None:
        """``%chat --no-thinking`` / ``--template-arg`` / ``--clear-template-args``: for every later turn."""
        conversation = self.conversation
        if args.clear_template_args:
            conversation.thinking, conversation.template_options = None, {}
        if args.thinking is not None:
            conversation.thinking = args.thinking
        conversation.template_options = {**conversation.template_options, **args.template_options}
        print(conversation.template_line())

    def _reply(self, text: str, args):
        # imported on first use: it brings in transformers, which the kernel's start need not wait for
        from shardbook.kernel.api.chat import SETTINGS, ChatModel
        from shardbook.kernel.api.replies import ReplyParts, request_format

        relay = RankRelay(frontend_for(self.shell), label_ranks=True)
        try:
            runtime = get_runtime(self.shell)
            model = ChatModel(runtime)
            if self.conversation.system_prompt is None and runtime.ctx0.state.get("config") is not None:
                self.conversation.system_prompt = runtime.ctx0.state["config"].inference.system_prompt
            settings = {k: getattr(args, k) for k in SETTINGS if k != "want_scores"}
            options = {**self.conversation.template_options, **args.template_options}
            loop = self._tool_loop(runtime, args, relay) if args.tools else None
            if loop is not None:
                if "tools" in options:
                    relay.notice("--tools replaces the template option tools given by --template-arg")
                options["tools"] = loop.schemas

            def request_for(messages):
                return model.build_request(
                    messages,
                    system_prompt=None,
                    want_scores=args.scores,
                    thinking=self.conversation.thinking if args.thinking is None else args.thinking,
                    template_options=options,
                    **settings,
                )

            request = request_for(self.conversation.request_messages(text))
            fmt = request_format(runtime, request)  # renders the prompt: a template that cannot fails here, on rank 0
        except (PoolError, ValueError) as e:
            raise UsageError(str(e)) from e
        notice = model.template_notice({k: v for k, v in request.template_options.items() if k != "tools"})
        if notice:
            relay.notice(notice)
        if loop is not None:
            return self._run_tool_loop(runtime, loop, request_for, args, text, relay)

        def keep(response):
            self.conversation.add_turn(text, response.text, response.finish_reason, response.reasoning)

        parts = ReplyParts(fmt)
        response = parts.apart(self._stream_reply(runtime, request, parts, args, relay, keep_partial=keep))
        keep(response)
        self.shell.user_ns["_chat"] = response

    def _tool_loop(self, runtime, args, relay):
        """The loop for ``--tools NAME``: NAME is a list of functions in the notebook's namespace."""
        from shardbook.kernel.api.tools import ToolLoop, tool_format

        tools = self.shell.user_ns.get(args.tools)
        if callable(tools):
            tools = [tools]
        if not isinstance(tools, (list, tuple)):
            raise ValueError(
                f"--tools {args.tools}: the notebook has no list of functions named {args.tools!r} "
                f"(found {type(tools).__name__}); define one first, e.g. `{args.tools} = [get_weather]`"
            )
        return ToolLoop(list(tools), tool_format(runtime), max_steps=args.max_tool_steps, on_step=show_step)

    def _run_tool_loop(self, runtime, loop, request_for, args, text: str, relay):
        """Each of the model's replies streamed into a view of its own, each call shown as it runs; the user's
        message, the calls, their results and the answer join the conversation, even when interrupted."""
        from dataclasses import replace

        from shardbook.kernel.api.replies import prompt_text, request_format
        from shardbook.kernel.api.tools import ModelReply

        def reply(messages):
            try:
                request = request_for(messages)
                parts = loop.reply_parts(request_format(runtime, request))
            except (PoolError, ValueError) as e:  # e.g. past the model's context, or a template refusing a result
                raise UsageError(str(e)) from e
            response = self._stream_reply(runtime, request, parts, args, relay)
            return ModelReply(response, parts, request.messages, prompt_text(runtime, request))

        response = None
        try:
            response = loop.run(self.conversation.request_messages(text), reply)
        except KeyboardInterrupt:  # between two replies, outside the streams and the tools
            if loop.last is None:
                raise
            response = replace(loop.last, finish_reason="interrupted", steps=tuple(loop.steps))
        finally:  # what the loop did is kept even when a reply failed
            if loop.last is not None:
                done = response or replace(loop.last, steps=tuple(loop.steps))
                user = {"role": "user", "content": text}
                self.conversation.add_messages([user, *loop.messages], done.text, done.finish_reason, done.reasoning)
                self.shell.user_ns["_chat"] = done
        if loop.limit_message:
            relay.notice(loop.limit_message)

    def _stream_reply(self, runtime, request, parts, args, relay, keep_partial=None):
        """One reply streamed into a view, its reasoning apart (``parts``); the response as generated.
        ``keep_partial`` gets the split reply when a rank failed after the reply was stopped."""
        from shardbook.kernel.api.batch import batch_refusal
        from shardbook.kernel.api.chat import BatchChatStream, ChatStream, GenerationFailed
        from shardbook.kernel.ranks.foreground import sigint_calls

        use_widget = args.output == "widget" or (args.output is None and widgets_available(self.shell))
        view = WidgetChatView() if use_widget else TextChatView()
        if args.no_batch or batch_refusal(runtime) is not None:  # a model the batch cannot hold replies alone
            stream = ChatStream(runtime, request, on_notice=relay.notice, start=False)
        else:
            stream = BatchChatStream(runtime, request, on_notice=relay.notice, start=False)
        # from the start of the command until its reply is kept, the stop button only stops
        # the reply: a KeyboardInterrupt elsewhere would end the cell with the ranks still generating
        with sigint_calls(stream.stop):
            try:
                stream.start()
            except (PoolError, ValueError) as e:  # e.g. a prompt beyond the model's context or the KV budget
                raise UsageError(str(e)) from e
            try:
                for chunk in stream:
                    view.add(parts.feed(chunk))
                view.add(parts.finish())
            except GenerationFailed as e:
                if stream.stopped and stream.response is not None and keep_partial:  # the partial reply happened
                    keep_partial(parts.apart(stream.response))
                view.fail("a rank failed")
                raise_for_outcome(e.outcome)
            except PoolError as e:
                view.fail(str(e))
                raise UsageError(str(e)) from e
            response = parts.apart(stream.response)
            view.finish(response.status_line(), Split(response.reasoning, response.text))
            if response.scores:
                display(ScoresView(response.scores))
        return stream.response
