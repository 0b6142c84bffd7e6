"""``%%chat``: multi-turn chat with the sharded model, streamed live; ``%chat`` manages the conversation."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments
from IPython.display import display

from shardbook.kernel.api.conversation import Conversation, parse_template_args
from shardbook.kernel.api.reasoning import Split
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.magics.arguments import parse_line
from shardbook.magics.errors import raise_for_outcome
from shardbook.magics.relay import RankRelay, frontend_for
from shardbook.magics.views.chat_view import ScoresView, TextChatView, WidgetChatView
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

        try:
            runtime = get_runtime(self.shell)
            model = ChatModel(runtime)
            if self.conversation.system_prompt is None and runtime.ctx0.state.get("config") is not None:
                self.conversation.system_prompt = runtime.ctx0.state["config"].inference.system_prompt
            settings = {k: getattr(args, k) for k in SETTINGS if k != "want_scores"}
            request = model.build_request(
                self.conversation.request_messages(text),
                system_prompt=None,
                want_scores=args.scores,
                thinking=self.conversation.thinking if args.thinking is None else args.thinking,
                template_options={**self.conversation.template_options, **args.template_options},
                **settings,
            )
        except (PoolError, ValueError) as e:
            raise UsageError(str(e)) from e
        self._stream_reply(runtime, model, request, args, text)

    def _stream_reply(self, runtime, model, request, args, text: str):
        """One reply streamed into a view, its reasoning apart; it joins the conversation and becomes ``_chat``."""
        from shardbook.kernel.api.batch import batch_refusal
        from shardbook.kernel.api.chat import BatchChatStream, ChatStream, GenerationFailed
        from shardbook.kernel.api.replies import ReplyParts, request_format
        from shardbook.kernel.ranks.foreground import sigint_calls

        use_widget = args.output == "widget" or (args.output is None and widgets_available(self.shell))
        view = WidgetChatView() if use_widget else TextChatView()
        relay = RankRelay(frontend_for(self.shell), label_ranks=True)
        notice = model.template_notice(request.template_options)
        if notice:
            relay.notice(notice)
        parts = ReplyParts(request_format(runtime, request))
        if args.no_batch or batch_refusal(runtime) is not None:  # the model or its interventions need one reply
            stream = ChatStream(runtime, request, on_notice=relay.notice, start=False)
        else:
            stream = BatchChatStream(runtime, request, on_notice=relay.notice, start=False)
        # from the start of the command until its reply is in the history, the stop button only stops
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
                if stream.stopped and stream.response is not None:  # the partial reply happened: keep the turn
                    partial = parts.apart(stream.response)
                    self.conversation.add_turn(text, partial.text, partial.finish_reason, partial.reasoning)
                view.fail("a rank failed")
                raise_for_outcome(e.outcome)
            except PoolError as e:
                view.fail(str(e))
                raise UsageError(str(e)) from e
            response = parts.apart(stream.response)
            self.conversation.add_turn(text, response.text, response.finish_reason, response.reasoning)
            self.shell.user_ns["_chat"] = response
            view.finish(response.status_line(), Split(response.reasoning, response.text))
            if response.scores:
                display(ScoresView(response.scores))
