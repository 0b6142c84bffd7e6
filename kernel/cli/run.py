"""`shardbook run`: execute a notebook headless on a temporary N-rank kernel, echoing outputs live.

The run installs a throwaway shardbook kernelspec into a temporary directory, puts that
directory on JUPYTER_PATH for the length of the run, and lets nbclient drive the kernel the
way a frontend would. Every output is printed the moment its IOPub message arrives: stream
text as is (stdout to stdout, stderr to stderr), display data and results as their
text/markdown or text/plain form, errors as ``ename: evalue`` and the traceback (to stderr).
Cell headers and the final summary go to stderr, so stdout holds only what the cells printed.

The executed notebook, widget state included, is written to ``--output`` (default: next to
the input, ``NAME.out.ipynb``), also when a cell fails, so the failure can be inspected.
The kernel is always shut down; it takes its ranks with it.

    shardbook run notebooks/hello_ranks.ipynb --nproc 2
    shardbook run train.ipynb --nproc 4 --output runs/train.ipynb --timeout 3600

Exit status: 0 when every cell ran, 1 when a cell failed, timed out or the kernel died,
2 when the notebook or the options are unusable (nothing was run).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from shardbook.kernel.cli import kernelspec

DEFAULT_TIMEOUT_S = 600
STARTUP_TIMEOUT_S = 120
EXIT_CELL_FAILED = 1
EXIT_BAD_INPUT = 2
SOURCE_HEAD_LINES = 3
ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
DEFAULT_SPEC_NAME = re.compile(rf"^{kernelspec.DEFAULT_NAME_PREFIX}-(\d+)$")


class RunFailed(RuntimeError):
    """The notebook started running but did not finish: a cell failed, timed out, or the kernel died."""


def load_notebook(path: Path):
    """The notebook at `path` as nbformat 4; ValueError saying what is wrong with the file otherwise."""
    import nbformat

    if not path.is_file():
        reason = "is a directory" if path.is_dir() else "does not exist"
        raise ValueError(f"notebook {path} {reason}; give the path of an .ipynb file")
    try:
        text = path.read_text(encoding="utf-8")
        raw = json.loads(text)
        if not isinstance(raw, dict) or "nbformat" not in raw:
            raise ValueError('the JSON has no top-level "nbformat" field')  # nbformat would take it for version 1
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
        nbformat.validate(nb)  # reads() only logs schema errors
        return nbformat.convert(nb, 4)
    except (OSError, ValueError, nbformat.ValidationError) as e:  # JSONDecodeError, UnicodeDecodeError: ValueErrors
        raise ValueError(
            f"{path} is not a valid Jupyter notebook ({str(e).splitlines()[0]}); "
            "open it in Jupyter and save it again, or check that it is an .ipynb file"
        ) from e


def default_output_path(notebook: Path) -> Path:
    """Where the executed notebook goes without --output: ``NAME.out.ipynb`` next to the input."""
    return notebook.with_name(f"{notebook.stem}.out.ipynb")


def check_output_path(output: Path) -> None:
    """Fail before running, not after, when the executed notebook could not be written."""
    if output.is_dir():
        raise ValueError(f"--output {output} is a directory; give a file name such as {output / 'out.ipynb'}")
    if not output.parent.is_dir():
        raise ValueError(f"--output {output}: directory {output.parent} does not exist; create it first")


def nproc_from_notebook(nb) -> int | None:
    """The rank count of the notebook's saved kernelspec when it is a default ``shardbook-N`` one."""
    match = DEFAULT_SPEC_NAME.match(nb.metadata.get("kernelspec", {}).get("name", ""))
    return int(match.group(1)) if match else None


def choose_layout(args: argparse.Namespace, nb) -> kernelspec.Layout:
    """--nproc, else the notebook's ``shardbook-N`` kernelspec, else one rank."""
    if args.nproc is not None:
        return kernelspec.Layout(args.nproc)
    nproc = nproc_from_notebook(nb)
    source = f"from the notebook's kernelspec {nb.metadata.kernelspec.name}" if nproc else "no --nproc given"
    nproc = nproc or 1
    print(f"shardbook run: {nproc} rank(s), {source}; --nproc N to change", file=sys.stderr)
    return kernelspec.Layout(nproc)


@contextmanager
def temporary_kernelspec(layout: kernelspec.Layout) -> Iterator[str]:
    """Install a kernelspec for `layout` in a temp dir on JUPYTER_PATH; yield its name; undo both afterwards."""
    name = f"{kernelspec.default_name(layout)}-run-{os.getpid()}"
    options = kernelspec.KernelSpecOptions(layout, f"shardbook run ({layout.nproc} ranks)")
    previous = os.environ.get("JUPYTER_PATH")
    with tempfile.TemporaryDirectory(prefix="shardbook-run-") as tmp:
        spec_dir = Path(kernelspec.install(options, name, user=False, prefix=tmp))
        data_dir = spec_dir.parent.parent  # PREFIX/share/jupyter/kernels/NAME -> PREFIX/share/jupyter
        os.environ["JUPYTER_PATH"] = os.pathsep.join([str(data_dir), *([previous] if previous else [])])
        try:
            yield name
        finally:
            if previous is None:
                del os.environ["JUPYTER_PATH"]
            else:
                os.environ["JUPYTER_PATH"] = previous


WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def output_text(out) -> str:
    """What the terminal shows for one notebook output."""
    kind = out.output_type
    if kind == "stream":
        return out.text
    if kind == "error":
        return "\n".join([f"{out.ename}: {out.evalue}", *out.traceback]) + "\n"
    data = out.get("data", {})
    if WIDGET_VIEW in data:
        # a live widget (a %%chat reply as it streams, a slider): its text/plain is a repr such as
        # HTML(value="<div class='shardbook-reply' ..."), nothing a person reads; a %%chat reply's final
        # rendering arrives as an update of the same display and is printed then
        return ""
    for mime in ("text/markdown", "text/plain"):
        if mime in data:
            return data[mime].rstrip("\n") + "\n"
    return f"[{', '.join(data) or 'empty'} output, not shown in a terminal]\n"


def write_terminal(stream, text: str) -> None:
    """Write and flush at once, without colour codes when the stream is not a terminal."""
    if not stream.isatty():
        text = ANSI_ESCAPE.sub("", text)
    stream.write(text)
    stream.flush()


def echo_output(out) -> None:
    """Print one output where it belongs: stderr streams and errors to stderr, the rest to stdout."""
    to_stderr = out.output_type == "error" or (out.output_type == "stream" and out.name == "stderr")
    write_terminal(sys.stderr if to_stderr else sys.stdout, output_text(out))


def source_head(cell) -> str:
    """The first lines of a cell's source, indented, for messages."""
    lines = cell.source.strip().splitlines()
    more = ["..."] if len(lines) > SOURCE_HEAD_LINES else []
    return "\n".join(f"    {line}" for line in lines[:SOURCE_HEAD_LINES] + more)


def cell_label(nb, index: int) -> str:
    """A cell's 1-based position, e.g. ``cell 3/5``."""
    return f"cell {index + 1}/{len(nb.cells)}"


def echoing_client(nb, echo: Callable, **options):
    """A NotebookClient that hands every output to `echo` as soon as its IOPub message arrives."""
    from nbclient import NotebookClient
    from nbformat.v4 import output_from_msg

    class EchoingClient(NotebookClient):
        def output(self, outs, msg, display_id, cell_index):
            out = super().output(outs, msg, display_id, cell_index)
            if out is not None:  # None: not an output, or captured by an Output widget
                echo(out)
            return out

        def process_message(self, msg, cell, cell_index):
            if msg["msg_type"] == "update_display_data":  # a live view turned into its final rendering
                echo(output_from_msg({**msg, "header": {**msg["header"], "msg_type": "display_data"}}))
            return super().process_message(msg, cell, cell_index)

    return EchoingClient(nb, **options)


def announce_cell(nb) -> Callable:
    """The on_cell_execute hook: a header on stderr before each code cell runs."""

    def hook(cell, cell_index: int) -> None:
        first = cell.source.strip().splitlines()[0]
        write_terminal(sys.stderr, f"--- {cell_label(nb, cell_index)}: {first}\n")

    return hook


def execute(nb, kernel_name: str, workdir: Path, timeout_s: int) -> None:
    """Run every cell of `nb` in place on the kernel `kernel_name`; RunFailed naming the cell that stopped the run."""
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError

    current = {}  # on_cell_start records the index of the cell being run
    client = echoing_client(
        nb,
        echo_output,
        kernel_name=kernel_name,
        timeout=timeout_s,
        startup_timeout=STARTUP_TIMEOUT_S,
        interrupt_on_timeout=True,
        error_on_timeout={
            "ename": "CellTimeoutError",
            "evalue": f"the cell ran past --timeout {timeout_s} s and was interrupted on every rank",
            "traceback": [],
        },
        store_widget_state=True,
        resources={"metadata": {"path": str(workdir)}},
        on_cell_execute=announce_cell(nb),
        on_cell_start=lambda cell, cell_index: current.update(index=cell_index),
    )
    try:
        client.execute()
    except CellExecutionError as e:
        index = current["index"]
        raise RunFailed(
            f"{cell_label(nb, index)} (index {index}) failed with {e.ename}: {e.evalue}\n{source_head(nb.cells[index])}"
        ) from e
    except DeadKernelError as e:
        raise RunFailed(
            f"the kernel died during {cell_label(nb, current['index'])}: a rank crashed or exited, "
            "or Ctrl-C stopped the run; the kernel's last messages are above"
        ) from e
    except (CellTimeoutError, RuntimeError, TimeoutError) as e:  # start-up failures, IOPub timeouts
        where = f"during {cell_label(nb, current['index'])}" if "index" in current else "while starting"
        raise RunFailed(f"the kernel failed {where}: {type(e).__name__}: {e}") from e
    finally:
        client.set_widgets_metadata()  # nbclient stores widget state only after a complete run


def write_notebook(nb, output: Path) -> None:
    """Save the (possibly partly) executed notebook."""
    import nbformat

    nbformat.write(nb, output)


def prepare(args: argparse.Namespace):
    """Everything checked before a kernel starts: the notebook, the output path, the layout, the timeout."""
    if args.timeout <= 0:
        raise ValueError(f"--timeout must be a positive number of seconds, got {args.timeout}")
    notebook = Path(args.notebook).expanduser()
    nb = load_notebook(notebook)
    output = Path(args.output).expanduser() if args.output else default_output_path(notebook)
    check_output_path(output)
    return notebook, nb, output, choose_layout(args, nb)


def run_notebook(args: argparse.Namespace) -> int:
    """Run `shardbook run` for parsed `args`; return the process exit status."""
    try:
        notebook, nb, output, layout = prepare(args)
    except ValueError as e:
        print(f"shardbook run: error: {e}", file=sys.stderr)
        return EXIT_BAD_INPUT
    status, summary = 0, f"all cells ran; executed notebook written to {output}"
    try:
        with temporary_kernelspec(layout) as kernel_name:
            execute(nb, kernel_name, notebook.resolve().parent, args.timeout)
    except RunFailed as e:
        status, summary = EXIT_CELL_FAILED, f"{e}\nshardbook run: the partly executed notebook is in {output}"
    write_notebook(nb, output)
    print(f"shardbook run: {summary}", file=sys.stderr)
    return status


def add_run_parser(subparsers) -> argparse.ArgumentParser:
    """Register `shardbook run NOTEBOOK [--nproc N] [--output OUT] [--timeout S]`; args carry `run=run_notebook`."""
    parser = subparsers.add_parser(
        "run",
        help="execute a notebook headless on an N-rank kernel, printing outputs as they arrive",
        description=__doc__.split("\n\n", 1)[1],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("notebook", help="the .ipynb file to execute")
    parser.add_argument(
        "--nproc",
        type=int,
        default=None,
        metavar="N",
        help="ranks to run (default: N of the notebook's shardbook-N kernelspec, else 1)",
    )
    parser.add_argument(
        "--output",
        metavar="OUT.ipynb",
        help="where to write the executed notebook (default: NAME.out.ipynb next to NOTEBOOK)",
    )
    parser.add_argument(
        "--timeout",
        type=int,
        default=DEFAULT_TIMEOUT_S,
        metavar="S",
        help=f"per-cell limit in seconds; a cell past it is interrupted on every rank (default {DEFAULT_TIMEOUT_S})",
    )
    parser.set_defaults(run=run_notebook)
    return parser
