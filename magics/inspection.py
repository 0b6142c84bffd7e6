"""Inspection magics: ``%%trace``, ``%logit_lens``, ``%param`` (and ``full_parameter``), ``%intervene``, ``%share``."""

from __future__ import annotations

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, line_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments
from IPython.display import Image, display

from shardbook.kernel.api.inspection import DEFAULT_MAX_MB, InspectionFailed, Inspector
from shardbook.kernel.ranks.pool import PoolError
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.magics.arguments import parse_line
from shardbook.magics.errors import raise_for_outcome
from shardbook.magics.loading import loaded_model
from shardbook.magics.relay import RankRelay, frontend_for
from shardbook.magics.views.lens_view import heatmap_png, lens_table
from shardbook.magics.views.patch_view import patch_heatmap_png, patch_table


def max_mb_option(fn):
    return argument(
        "--max-mb",
        type=float,
        default=DEFAULT_MAX_MB,
        metavar="MB",
        help=f"refuse a result larger than this on rank 0 (default {DEFAULT_MAX_MB:.0f} MiB)",
    )(fn)


def layer_globs(spec: list[str], layer_names: list[str]) -> list[str]:
    """``--layers`` items: indices (``3``), ranges (``0-5``) or module globs, as module globs."""
    globs = []
    for item in (part for text in spec for part in text.split(",") if part):
        low, _, high = item.partition("-")
        if not (low.isdigit() and (high.isdigit() or not high)):
            globs.append(item)
            continue
        first, last = int(low), int(high or low)
        if not first <= last < len(layer_names):
            raise UsageError(
                f"--layers {item}: the model has layers 0-{len(layer_names) - 1}; give indices, ranges "
                "such as 0-5, or module globs"
            )
        globs += layer_names[first : last + 1]
    return globs


@magics_class
class InspectionMagics(Magics):
    """Look inside the sharded model: activations, the logit lens, parameters, interventions."""

    def __init__(self, shell):
        super().__init__(shell)
        shell.user_ns.setdefault("full_parameter", self.full_parameter)
        shell.set_hook("complete_command", self._complete_parameter, str_key="%param")

    def _inspector(self) -> tuple[Inspector, RankRelay]:
        try:
            runtime = get_runtime(self.shell)
        except PoolError as e:
            raise UsageError(str(e)) from e
        relay = RankRelay(frontend_for(self.shell), label_ranks=True)
        return Inspector(runtime, relay, relay.notice), relay

    def _call(self, command: str, /, *args, **kwargs):
        inspector, _ = self._inspector()
        try:
            return getattr(inspector, command)(*args, **kwargs)
        except InspectionFailed as e:
            raise_for_outcome(e.outcome)
        except (PoolError, ValueError) as e:
            raise UsageError(str(e)) from e

    @magic_arguments()
    @argument("prompt", nargs="*", help="(line magic) the prompt; the cell magic reads it from the cell")
    @argument(
        "--modules",
        nargs="+",
        metavar="GLOB",
        help="modules to capture (default: every decoder layer); "
        "`*` is one part of a dotted name, `**` any number: model.layers.*, model.layers.3.self_attn",
    )
    @argument("--inputs", action="store_true", help="capture each module's first input instead of its output")
    @argument("--chat", action="store_true", help="format the prompt as one user message with the chat template")
    @argument("--as", dest="name", default="_trace", metavar="NAME", help="variable for the result (default _trace)")
    @argument(
        "--grad",
        metavar="METRIC",
        help="a function fn(logits) -> scalar defined in %%%%all: each capture's gradient of it goes in .grads",
    )
    @argument("--prompts", metavar="NAME", help="trace every prompt of this list (a variable of rank 0)")
    @argument("--in", dest="infile", metavar="FILE", help='trace every prompt of a JSON-lines file ({"prompt": ...})')
    @argument("--batch-size", type=int, default=8, metavar="N", help="prompts per forward with --prompts/--in")
    @argument(
        "--reduce",
        choices=["mean", "sum", "max", "var"],
        help="reduce each capture over every token of every prompt on the ranks; only the result reaches rank 0",
    )
    @argument("--per-prompt", action="store_true", help="with --reduce: one row per prompt")
    @argument("--project", metavar="NAME", help="with --reduce: multiply by this matrix [features, k] (%%share it)")
    @argument("--to", metavar="DIR", help="write unreduced captures to safetensors files in DIR instead")
    @max_mb_option
    @line_cell_magic("trace")
    def trace(self, line: str, cell: str | None = None):
        """Run a prompt through the model once on every rank and capture module outputs, whole on rank 0. Example::

            %%trace --modules model.layers.* --as clean
            The capital of France is

        ``clean["model.layers.3"]`` is then layer 3's output (on CPU, [1, tokens, hidden]);
        ``clean.tokens``, ``clean.token_ids`` and ``clean.logits`` hold the rest. The line magic
        returns the trace instead, for loops: ``t = %trace The capital of France is --modules model.layers.{i}``
        (the prompt first, then the flags).

        Many prompts, in batches (line form): ``many = %trace --prompts prompts --batch-size 16`` (or
        ``--in prompts.jsonl``) gives one trace per prompt; add ``--reduce mean`` (sum, max, var; ``--per-prompt``,
        ``--project NAME``) to reduce on the ranks, or ``--to DIR`` to write the captures to safetensors files.
        ``--grad FN`` (one prompt) adds each capture's gradient of ``FN(logits)``, a function defined in ``%%all``.
        """
        args = parse_line(self.trace, line)
        if args.prompts or args.infile:
            return self._trace_many(args, cell)
        if cell is not None and args.prompt:
            raise UsageError(
                "%%trace reads its prompt from the cell: leave it off the first line (or use the line magic %trace)"
            )
        text = " ".join(args.prompt) if cell is None else cell
        prompt = text.rstrip("\n") if args.chat else text.strip()
        if not prompt:
            raise UsageError("%%trace needs a prompt in the cell body, e.g.\n%%trace\nThe capital of France is")
        result = self._call(
            "trace", prompt, args.modules, inputs=args.inputs, chat=args.chat, max_mb=args.max_mb, grad=args.grad
        )
        if cell is None:
            return result
        self.shell.user_ns[args.name] = result
        print(f"{args.name}: {result!r}")

    def _trace_many(self, args, cell: str | None):
        """``--prompts NAME`` / ``--in FILE``: a batched trace; the cell (if any) must be empty."""
        from shardbook.rankd.inspection.batched import read_prompts_file

        if (cell or "").strip() or args.prompt:
            raise UsageError("with --prompts or --in the prompts come from there: leave the cell and the line empty")
        if args.prompts and args.infile:
            raise UsageError("give --prompts NAME or --in FILE, not both")
        if args.grad:
            raise UsageError("--grad takes one prompt: leave out --prompts / --in")
        if args.infile:
            try:
                prompts = read_prompts_file(args.infile)
            except (OSError, ValueError) as e:
                raise UsageError(str(e)) from e
        else:
            prompts = self.shell.user_ns.get(args.prompts)
            if not isinstance(prompts, (list, tuple)) or not prompts or not all(isinstance(p, str) for p in prompts):
                raise UsageError(f"--prompts {args.prompts}: rank 0 has no non-empty list of strings of that name")
        if (args.per_prompt or args.project) and not args.reduce:
            raise UsageError("--per-prompt and --project go with --reduce")
        result = self._call(
            "trace_many",
            list(prompts),
            args.modules,
            batch_size=args.batch_size,
            reduce=args.reduce,
            per_prompt=args.per_prompt,
            project=args.project,
            to=args.to,
            inputs=args.inputs,
            chat=args.chat,
            max_mb=args.max_mb,
        )
        if cell is None:
            return result
        self.shell.user_ns[args.name] = result
        print(f"{args.name}: {result!r}")

    @magic_arguments()
    @argument("prompt", nargs="+", help="the text to read (quote it or not)")
    @argument("--layers", nargs="+", metavar="L", help="layer indices, ranges (0-5) or module globs (default: all)")
    @argument("--top", type=int, default=5, help="top tokens kept per layer and position (default 5)")
    @argument("--chat", action="store_true", help="format the prompt as one user message with the chat template")
    @line_magic("logit_lens")
    def logit_lens(self, line: str):
        """Project every layer's residual stream through the final norm and the unembedding. Example::

            %logit_lens The capital of France is

        Shows a heatmap (layers x positions, the top token in each cell, colour = its
        probability) and leaves the table in ``_lens`` (``_lens.rows``, ``_lens.lens``).
        """
        args = parse_line(self.logit_lens, line)
        prompt = " ".join(args.prompt).strip("'\"")
        if args.top < 1:
            raise UsageError("--top must be at least 1")
        layers = None
        if args.layers:
            from shardbook.rankd.inspection.tracing import layer_names

            layers = layer_globs(args.layers, layer_names(loaded_model(self._inspector()[0].runtime).model))
        result = self._call("logit_lens", prompt, layers, top=args.top, chat=args.chat)
        table = lens_table(result.lens, result.tokens)
        self.shell.user_ns["_lens"] = table
        display(Image(heatmap_png(result.lens, result.tokens, title=f"logit lens: {prompt[:60]}")))

    @magic_arguments()
    @argument("--clean", required=True, metavar="NAME", help="a prompt (a string variable of rank 0)")
    @argument("--corrupt", required=True, metavar="NAME", help="a prompt of the same length (a string variable)")
    @argument("--modules", nargs="+", required=True, metavar="GLOB", help="modules to patch, e.g. model.layers.*")
    @argument("--metric", required=True, metavar="FN", help="a function fn(logits) -> scalar defined in %%all")
    @argument("--method", choices=["activation", "attribution"], default="activation", help="exact or first-order")
    @argument("--chat", action="store_true", help="format both prompts with the chat template")
    @argument("--as", dest="name", default="_patch", metavar="NAME", help="variable for the table (default _patch)")
    @line_magic("patch")
    def patch(self, line: str):
        """Activation patching: for each module and position, the metric on the corrupt prompt with that output
        taken from the clean prompt. Example::

            %%all
            def paris_vs_rome(logits):
                return logits[0, -1, 7042] - logits[0, -1, 9552]

            clean, corrupt = "The capital of France is", "The capital of Italy is"
            %patch --clean clean --corrupt corrupt --modules model.layers.* --metric paris_vs_rome

        Shows a heatmap and leaves the table in ``_patch`` (``_patch.rows``, ``_patch.result["effect"]``).
        ``--method attribution`` estimates the same table from one forward and backward.
        """
        args = parse_line(self.patch, line)
        prompts = []
        for flag, name in (("--clean", args.clean), ("--corrupt", args.corrupt)):
            value = self.shell.user_ns.get(name)
            if not isinstance(value, str):
                raise UsageError(f"{flag} {name}: rank 0 has no string variable of that name")
            prompts.append(value)
        result = self._call("patch", *prompts, args.modules, args.metric, method=args.method, chat=args.chat)
        table = patch_table(result)
        self.shell.user_ns[args.name] = table
        display(Image(patch_heatmap_png(result, f"{args.method} patching: {args.metric}")))
        print(table)

    def full_parameter(self, name: str, max_mb: float = DEFAULT_MAX_MB):
        """The whole parameter ``name`` on rank 0 (a CPU tensor) under every layout,
        e.g. ``full_parameter("lm_head.weight")``."""
        return self._call("full_parameter", name, max_mb=max_mb)

    @magic_arguments()
    @argument("name", help="the parameter's name, as in model.named_parameters() (Tab completes it)")
    @max_mb_option
    @line_magic("param")
    def param(self, line: str):
        """The whole parameter on rank 0, gathered from the ranks' shards. Example::

        w = %param model.layers.0.self_attn.q_proj.weight
        """
        args = parse_line(self.param, line)
        return self.full_parameter(args.name, max_mb=args.max_mb)

    def _complete_parameter(self, shell, event) -> list[str]:
        try:
            model = loaded_model(get_runtime(self.shell)).model
        except (PoolError, UsageError):
            return []
        return [n for n, _ in model.named_parameters() if n.startswith(event.symbol)]

    @magic_arguments()
    @argument("function", nargs="?", help="name of a function every rank defined in %%all: fn(output, module_name)")
    @argument("modules", nargs="*", metavar="GLOB", help="modules whose output it changes")
    @argument(
        "--input", action="store_true", help="change the module's first input instead (o_proj's input: per-head values)"
    )
    @argument("--remove", metavar="NAME", help="remove this intervention")
    @argument("--clear", action="store_true", help="remove every intervention")
    @argument("--quiet", "-q", action="store_true", help="do not list the interventions afterwards")
    @line_magic("intervene")
    def intervene(self, line: str):
        """Apply a function to module outputs on every rank, in every later forward (%%trace, %%chat, ...). Example::

            %%all
            def ablate(output, module_name):
                return output * 0

            %intervene ablate model.layers.3.mlp
            %intervene                      # list them
            %intervene --remove ablate

        The function gets the whole tensor (gathered under ``tp``) and returns a tensor of the same
        shape, or None after changing it in place.
        """
        args = parse_line(self.intervene, line)
        if args.function and args.modules:
            listed = self._call("intervene", args.function, args.modules, on_input=args.input)
        elif args.function:
            raise UsageError(
                f"%intervene {args.function}: name the modules too, e.g. %intervene {args.function} model.layers.3"
            )
        elif args.remove or args.clear:
            listed = self._call("remove", None if args.clear else args.remove)
        else:
            listed = self._call("interventions")
        if args.quiet:
            return
        for item in listed:
            print(f"{item['name']} on the {item['on']} of {', '.join(item['modules'])}")
        if not listed:
            print("no interventions")

    @magic_arguments()
    @argument("name", help="a tensor (or dict of tensors) in rank 0's namespace")
    @line_magic("share")
    def share(self, line: str):
        """Copy a rank-0 tensor (or a dict of tensors, such as a %%trace result) to every rank under the same name.

        Example::

        steer = clean["model.layers.3"][0, -1] - corrupt["model.layers.3"][0, -1]
        %share steer
        """
        args = parse_line(self.share, line)
        keys = self._call("share", args.name)
        print(f"{args.name} ({len(keys)} tensor(s)) is now on every rank")
