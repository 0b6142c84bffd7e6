"""Kernel round-trip benchmark for issue 2: shardbook against three anchors.

Every system is driven the way a frontend drives it: ``jupyter_client``'s
``KernelManager`` starts a kernel from a kernelspec, and ``tests.driver.execute``
(the tests' driver) sends ``execute_request`` through a ``BlockingKernelClient``
and reads iopub until ``status: idle`` for that ``msg_id`` (timed with
``time.perf_counter``).  All systems run in ONE
invocation, measured side by side (the runs of each test are interleaved
round-robin across the live kernels, in a rotating order), because this
machine is noisy and only ratios taken together mean much.

Systems (2 ranks / workers / engines each):

* ``floor``       plain ipykernel from this (shardbook's) venv, world of one.
* ``shardbook``   ``shardbook install --nproc 2`` kernelspec (its one-node
                  launcher, rank 0 is the kernel); broadcast cells are ``%%all``.  Skipped with a
                  message while ``shardbook install`` does not work yet.
* ``ipyparallel`` ipykernel + ``ipp.Cluster(n=2).start_and_connect_sync(
                  activate=True)``; broadcast cells are ``%%px``.
* ``jupyter-distributed`` its proxy kernel (``-m jupyter_distributed.kernel``,
                  the argv its server extension swaps in) with 2 rank kernels;
                  every cell is a broadcast.
* ``nbdistributed`` ipykernel + ``%load_ext nbdistributed`` / ``%dist_init -n 2``;
                  broadcast cells are ``%%distributed``.

Measured: (1) empty broadcast cell, (2) one line printed per rank, (3) 1000
lines per rank, checked complete and in order per rank before the
execute_reply, (4) kernel start (``start_kernel``) to the first broadcast
cell's reply, each system started alone (median of ``--startup-reps`` 3
fresh starts; shardbook's split from the marks its ranks write, and after each of its
starts one ``import torch`` in a fresh interpreter: the floor's start-up plus that import is
what shardbook's start-up is compared with), and (5) the shutdown of each of those kernels
(``shutdown_kernel(now=False)``, which sends SIGTERM after 2.5 s).  Targets
from the issue are printed as PASS/FAIL lines.

The anchors live in their own venv (never in shardbook's): their kernelspecs,
written to a temporary JUPYTER_PATH, point at that venv's python.  Set it up
once with::

    python bench/bench_kernel.py --setup-anchors

which runs exactly::

    python3.11 -m venv /tmp/anchors-venv
    /tmp/anchors-venv/bin/pip install -r bench/anchors/requirements.txt

(the file pins torch==2.13.0 ipyparallel==9.2.0 jupyter-distributed==0.1.1
nbdistributed==0.1.0; ``SHARDBOOK_ANCHORS_VENV`` or ``--anchors-venv`` move it)

(``torch==2.13.0`` resolves to the local CPU wheel on these machines; a bare
``torch`` elsewhere pulls GBs of CUDA wheels, so use a CPU-only torch index
there.  nbdistributed needs torch: its workers call ``init_process_group``
(gloo on CPU).  ipyparallel and jupyter-distributed do not.)  Then::

    .venv/bin/python bench/bench_kernel.py            # all systems, 50 runs
    .venv/bin/python bench/bench_kernel.py --runs 20 --only floor,shardbook

Safety note: nbdistributed's ``%dist_shutdown``/``%dist_reset`` run
``pkill -f nbdistributed``, ``pkill -9 -f "torch.*distributed"`` and similar,
which would kill unrelated torchrun jobs on the machine.  This harness never
calls them; it stops nbdistributed through the magic instance's own
``_process_manager.shutdown()`` (SIGTERM to its two workers; the classmethod
``DistributedMagic.shutdown_all()`` looks at class attributes that ``%dist_init``
never sets) and then reaps every process each kernel started, by pid.

``SHARDBOOK_BENCH_CLI`` replaces the ``shardbook`` command used for
``shardbook install`` (to test this harness with a stand-in).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

try:
    import psutil
except ImportError:  # ipykernel depends on psutil, so this is rare
    psutil = None

from jupyter_client.manager import KernelManager

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.driver: the kernel driver the tests use
from tests.driver import Execution, execute

WORLD = 2
BIG_LINES = 1000
ANCHORS_VENV = Path(os.environ.get("SHARDBOOK_ANCHORS_VENV", "/tmp/anchors-venv"))
ANCHOR_REQUIREMENTS = Path(__file__).resolve().parent / "anchors" / "requirements.txt"
LINE_RE = re.compile(r"L (\d+) (\d+)\s*$")


# --------------------------------------------------------------------------- #
# Setup of the anchors venv
# --------------------------------------------------------------------------- #
def setup_anchors(venv: Path, python: str) -> None:
    if not (venv / "bin" / "python").exists():
        cmd = [python, "-m", "venv", str(venv)]
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    cmd = [str(venv / "bin" / "pip"), "install", "-r", str(ANCHOR_REQUIREMENTS)]
    print("+", " ".join(cmd), flush=True)
    subprocess.run(cmd, check=True, cwd=tempfile.gettempdir())


# --------------------------------------------------------------------------- #
# Output parsers: iopub messages of one execute_request -> [(label, line)]
# label is the rank the system's own output format attributes the line to
# (None when the format does not say).
# --------------------------------------------------------------------------- #
def _stdout_text(msgs: list[dict]) -> str:
    return "".join(
        m["content"].get("text", "")
        for m in msgs
        if m["header"]["msg_type"] == "stream" and m["content"].get("name") == "stdout"
    )


def parse_plain(msgs: list[dict]) -> list[tuple[int | None, str]]:
    """A world of one (the floor): every stdout line is rank 0's."""
    return [(0, line) for line in _stdout_text(msgs).splitlines() if line.strip()]


_SB_LABEL = re.compile(r"^\[rank (\d+)\]\s?(.*)$")


def parse_shardbook(msgs: list[dict]) -> list[tuple[int | None, str]]:
    """shardbook: stream messages; a ``[rank N]`` line whenever the rank changes."""
    out, cur = [], None
    for line in _stdout_text(msgs).splitlines():
        m = _SB_LABEL.match(line)
        if m:
            cur = int(m.group(1))
            if m.group(2).strip():
                out.append((cur, m.group(2)))
            continue
        if line.strip():
            out.append((cur, line))
    return out


_IPP_PREFIX = re.compile(r"^\[stdout:(\d+)\] ?")


def parse_ipyparallel(msgs: list[dict]) -> list[tuple[int | None, str]]:
    """ipyparallel %%px in a kernel: per engine one display_data with
    display_id ``<engine msg id>-stdout``, then update_display_data messages each
    carrying the engine's WHOLE stdout so far, as ``[stdout:N] `` + text."""
    last: dict[str, str] = {}
    for m in msgs:
        if m["header"]["msg_type"] not in ("display_data", "update_display_data"):
            continue
        did = (m["content"].get("transient") or {}).get("display_id", "")
        text = m["content"].get("data", {}).get("text/plain", "")
        if did.endswith("-stdout") and _IPP_PREFIX.match(text):
            last[did] = text
    out = []
    for text in last.values():
        m = _IPP_PREFIX.match(text)
        rank = int(m.group(1))
        out += [(rank, line) for line in text[m.end() :].splitlines() if line.strip()]
    return out


JD_MIME = "application/vnd.jupyter-distributed.rank+json"


def parse_jupyter_distributed(msgs: list[dict]) -> list[tuple[int | None, str]]:
    """jupyter-distributed: one display_data (display_id per execution) whose
    JD_MIME payload holds every rank's outputs, re-sent whole as
    update_display_data when the cell finishes (live patches go over a comm
    that only its JupyterLab extension opens)."""
    last: dict[str, dict] = {}
    for m in msgs:
        if m["header"]["msg_type"] not in ("display_data", "update_display_data"):
            continue
        payload = m["content"].get("data", {}).get(JD_MIME)
        if payload is not None:
            last[(m["content"].get("transient") or {}).get("display_id", "")] = payload
    out = []
    for payload in last.values():
        for rank_res in payload.get("ranks", []):
            text = "".join(
                o["content"].get("text", "")
                for o in rank_res.get("outputs", [])
                if o.get("type") == "stream" and o["content"].get("name") == "stdout"
            )
            out += [(rank_res["rank"], line) for line in text.splitlines() if line.strip()]
    return out


_NBD_HEADER = re.compile(r"^\s*\W*\s*Rank (\d+):\s*$")


def parse_nbdistributed(msgs: list[dict]) -> list[tuple[int | None, str]]:
    """nbdistributed %%distributed: the kernel polls its workers every 100 ms and
    prints ``\\n🔹 Rank N:`` only before a rank's FIRST lines, then ``  <line>``
    for new lines of each rank in rank order, so later chunks of rank 0 follow
    rank 1's lines with no header: its labels are ambiguous by design."""
    out, cur = [], None
    for line in _stdout_text(msgs).splitlines():
        m = _NBD_HEADER.match(line)
        if m:
            cur = int(m.group(1))
        elif line.strip():
            out.append((cur, line.strip()))
    return out


# --------------------------------------------------------------------------- #
# Per-system adapters
# --------------------------------------------------------------------------- #
@dataclass
class System:
    key: str
    anchor: bool
    world: int
    # kernelspec dict (argv/env/...) or raises Skip; gets the temp dir
    kernelspec: Callable[[Path], dict]
    broadcast: Callable[[str], str]  # cell body -> cell source
    parse: Callable[[list[dict]], list[tuple[int | None, str]]]
    startup_cells: list[str] = field(default_factory=list)  # before first broadcast
    rank_cells: list[str] = field(default_factory=list)  # define `rank` everywhere
    teardown_cells: list[str] = field(default_factory=list)
    how: str = ""
    # stdout text by which a system reports a failed broadcast with status "ok"
    error_re: re.Pattern | None = None


class Skip(Exception):
    pass


def _anchor_python() -> Path:
    return ANCHORS_VENV / "bin" / "python"


def _require_anchor(*modules: str) -> Path:
    py = _anchor_python()
    if not py.exists():
        raise Skip(f"no anchors venv at {ANCHORS_VENV} (run with --setup-anchors)")
    probe = (
        "import importlib.util,sys; m=[n for n in sys.argv[1:] if importlib.util.find_spec(n) is None]; "
        "print(','.join(m))"
    )
    r = subprocess.run([str(py), "-c", probe, *modules], capture_output=True, text=True)
    missing = r.stdout.strip()
    if r.returncode or missing:
        raise Skip(f"not installed in {ANCHORS_VENV}: {missing or r.stderr.strip()[-200:]}")
    return py


def _anchor_env() -> dict:
    # nbdistributed launches its workers as plain "python" from PATH.
    return {"PATH": f"{ANCHORS_VENV / 'bin'}:{os.environ.get('PATH', '')}"}


def ks_floor(tmp: Path) -> dict:
    return {
        "argv": [sys.executable, "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "floor (plain ipykernel)",
        "language": "python",
    }


def compile_shardbook() -> None:
    """Write the bytecode of shardbook's sources, as pip does when it installs a wheel.

    The floor and the anchors start from compiled packages. An editable install gets its bytecode written on
    first import, except where ``PYTHONDONTWRITEBYTECODE`` is set (it is on these machines): then every rank
    of every start compiled shardbook's 120 modules again (0.1-0.3 s of rank 0's start-up here).
    """
    import compileall
    import importlib.util

    for package in ("shardbook", "shardbook.kernel", "shardbook.magics", "shardbook.rankd"):
        for folder in importlib.util.find_spec(package).submodule_search_locations:
            compileall.compile_dir(folder, quiet=1)


def ks_shardbook(tmp: Path) -> dict:
    compile_shardbook()
    exe = Path(sys.executable).with_name("shardbook")
    if os.environ.get("SHARDBOOK_BENCH_CLI"):  # e.g. a stand-in, to test this harness
        cli = os.environ["SHARDBOOK_BENCH_CLI"].split()
    elif exe.exists():
        cli = [str(exe)]
    else:
        cli = [sys.executable, "-c", "import sys; from shardbook.kernel.cli.main import main; sys.exit(main())"]
    prefix = tmp / "shardbook-prefix"
    cmd = [*cli, "install", "--nproc", str(WORLD), "--prefix", str(prefix), "--name", "bench-shardbook"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise Skip(f"`shardbook install` failed to run: {e}") from e
    if r.returncode:
        tail = (r.stderr or r.stdout).strip().splitlines()[-1:] or ["(no output)"]
        raise Skip(f"`shardbook install` exited {r.returncode}: {tail[0][:200]}")
    found = sorted(prefix.rglob("kernel.json"))
    if not found:
        raise Skip(f"`shardbook install` wrote no kernel.json under {prefix}")
    return json.loads(found[0].read_text())


def ks_ipyparallel(tmp: Path) -> dict:
    py = _require_anchor("ipyparallel", "ipykernel")
    return {
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "anchor ipyparallel",
        "language": "python",
        "env": _anchor_env(),
    }


def ks_jupyter_distributed(tmp: Path) -> dict:
    py = _require_anchor("jupyter_distributed", "ipykernel")
    # The base kernel each rank runs: the anchors venv's ipykernel.
    base = tmp / "jupyter" / "kernels" / "bench-jd-base"
    base.mkdir(parents=True, exist_ok=True)
    (base / "kernel.json").write_text(
        json.dumps(
            {
                "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
                "display_name": "jd base",
                "language": "python",
                "env": _anchor_env(),
            }
        )
    )
    # The same argv/env its Jupyter Server extension swaps into a kernel
    # (coordinator.configure_proxy), so no server is needed.
    return {
        "argv": [str(py), "-m", "jupyter_distributed.kernel", "-f", "{connection_file}"],
        "display_name": "anchor jupyter-distributed",
        "language": "python",
        "interrupt_mode": "message",
        "env": {
            **_anchor_env(),
            "JUPYTER_DISTRIBUTED_BASE_KERNEL": "bench-jd-base",
            "JUPYTER_DISTRIBUTED_WORLD_SIZE": str(WORLD),
            "JUPYTER_DISTRIBUTED_REGISTRY_FILE": str(tmp / "jd-registry.json"),
        },
    }


def ks_nbdistributed(tmp: Path) -> dict:
    py = _require_anchor("nbdistributed", "torch", "ipykernel")
    return {
        "argv": [str(py), "-m", "ipykernel_launcher", "-f", "{connection_file}"],
        "display_name": "anchor nbdistributed",
        "language": "python",
        "env": _anchor_env(),
    }


SYSTEMS = [
    System(
        "floor",
        False,
        1,
        ks_floor,
        lambda b: b,
        parse_plain,
        rank_cells=["rank = 0"],
        how="plain ipykernel (shardbook venv), cells run as-is",
    ),
    System(
        "shardbook",
        False,
        WORLD,
        ks_shardbook,
        lambda b: f"%%all\n{b}",
        parse_shardbook,
        rank_cells=["%%all\nimport os\nrank = int(os.environ['RANK'])"],
        how="`shardbook install --nproc 2` kernelspec (one-node launcher); `%%all` cells",
    ),
    System(
        "ipyparallel",
        True,
        WORLD,
        ks_ipyparallel,
        lambda b: f"%%px\n{b}",
        parse_ipyparallel,
        startup_cells=[
            (
                "import ipyparallel as ipp\n"
                "_bench_cluster = ipp.Cluster(n=2)\n"
                "rc = _bench_cluster.start_and_connect_sync(activate=True)"
            )
        ],
        rank_cells=["for _e in rc.ids:\n    rc[_e].push({'rank': _e}, block=True)"],
        teardown_cells=["_bench_cluster.stop_cluster_sync()"],
        how="ipykernel; ipp.Cluster(n=2).start_and_connect_sync(activate=True); `%%px` cells",
    ),
    System(
        "jupyter-distributed",
        True,
        WORLD,
        ks_jupyter_distributed,
        lambda b: b,
        parse_jupyter_distributed,
        rank_cells=["import os\nrank = int(os.environ['RANK'])"],
        how="kernelspec argv `-m jupyter_distributed.kernel` + JUPYTER_DISTRIBUTED_* env "
        "(what its server extension sets); ranks start on the first cell; every cell broadcasts",
    ),
    System(
        "nbdistributed",
        True,
        WORLD,
        ks_nbdistributed,
        lambda b: f"%%distributed\n{b}",
        parse_nbdistributed,
        # %dist_init returns after a fixed 2 s sleep, possibly before its
        # workers have connected; a command sent then is silently dropped by
        # its ZMQ ROUTER and the cell prints a timeout after 30 s.  So wait
        # until both workers answer (probes of 0.1 s), as a user would.
        startup_cells=[
            (
                "%load_ext nbdistributed\n%dist_init -n 2\n"
                "_m = get_ipython().magics_manager.registry['DistributedMagic']\n"
                "import time as _t\n"
                "_t0 = _t.monotonic()\n"
                "while True:\n"
                "    try:\n"
                "        _m._comm_manager.send_to_all('get_status', {}, timeout=0.1)\n"
                "        break\n"
                "    except TimeoutError:\n"
                "        _ps = _m._process_manager.processes\n"
                "        _dead = [(_i, _p.poll()) for _i, _p in enumerate(_ps) if _p.poll() is not None]\n"
                "        if _dead or _t.monotonic() - _t0 > 60:\n"
                "            raise RuntimeError(f'nbdistributed workers silent for "
                "{_t.monotonic() - _t0:.0f} s; exited (rank, code): {_dead}')"
            )
        ],
        rank_cells=[],  # `rank` is predefined in its workers
        # NOT %dist_shutdown: it pkills by pattern ("torch.*distributed", ...)
        teardown_cells=[
            "%dist_mode --disable",
            (
                "_m = get_ipython().magics_manager.registry['DistributedMagic']\n"
                "_m._process_manager.shutdown()\n_m._comm_manager.shutdown()"
            ),
        ],
        error_re=re.compile(r"Error executing distributed code|Error on Rank \d|No distributed workers"),
        how="ipykernel; `%load_ext nbdistributed` + `%dist_init -n 2` (+ wait until its workers answer); "
        "`%%distributed` cells",
    ),
]

CELL_EMPTY = "pass"
CELL_ONE = 'print(f"L {rank} 0")'
CELL_BIG = f'for _i in range({BIG_LINES}):\n    print(f"L {{rank}} {{_i}}")'


# --------------------------------------------------------------------------- #
# Driving a kernel
# --------------------------------------------------------------------------- #
class CellError(RuntimeError):
    pass


def run_ok(kc, code: str, timeout: float, error_re: re.Pattern | None = None) -> Execution:
    res = execute(kc, code, timeout)
    content = res.reply["content"]
    errs = [m["content"] for m in res.of_type("error")]
    if content.get("status") != "ok" or errs:
        e = errs[0] if errs else content
        raise CellError(f"{code[:40]!r} -> {e.get('ename')}: {str(e.get('evalue'))[:300]}")
    if error_re is not None:
        m = error_re.search(_stdout_text(res.messages))
        if m:
            raise CellError(f"{code[:40]!r} -> printed {m.group(0)!r}")
    return res


def verify_lines(system: System, res: Execution, n: int) -> dict:
    """All n lines of every rank, in order, sent before the execute_reply?"""
    reply_date = res.reply["header"]["date"]
    before = [m for m in res.messages if m["header"]["date"] <= reply_date]
    got = system.parse(before)
    late = len(system.parse(res.messages)) - len(got)
    per_rank: dict[int, list[int]] = {}
    label_ok = 0
    stray = 0
    for label, line in got:
        m = LINE_RE.search(line)
        if not m:
            stray += 1
            continue
        r, i = int(m.group(1)), int(m.group(2))
        per_rank.setdefault(r, []).append(i)
        label_ok += label == r
    complete = sorted(per_rank) == list(range(system.world)) and all(v == list(range(n)) for v in per_rank.values())
    total = sum(len(v) for v in per_rank.values())
    return {
        "ok": complete and late == 0,
        "lines": total,
        "expected": n * system.world,
        "late": late,
        "stray": stray,
        "labelled": label_ok,
    }


def descendants(pid: int) -> list:
    if psutil is None:
        return []
    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return []


STARTUP_STEPS = [
    ("launch (jupyter_client, the ranks' launcher)", "process"),
    ("rank 0's interpreter and shardbook.kernel.app", "python_up"),
    ("import ipykernel", "ipykernel_imported"),
    ("IPKernelApp set-up (as a plain ipykernel's)", "kernel_app_set_up"),
    ("import of the magics (torch, then shardbook's modules)", "magics_imported"),
    ("process group (torch.distributed rendezvous)", "process_group_up"),
    ("followers connected (their hello)", "ranks_connected"),
]
READY_STEP = "kernel_info answered (jupyter_client's wait_for_ready, incl. its 0.2 s IOPub flush)"


def read_marks(marks_file: Path) -> dict[str, dict[str, tuple[float, float]]]:
    """``{rank: {mark: (unix time, CPU s of the rank)}}`` from the file the ranks wrote
    (``SHARDBOOK_STARTUP_MARKS``); the first of each mark."""
    marks: dict[str, dict[str, tuple[float, float]]] = {}
    for line in marks_file.read_text().splitlines() if marks_file.exists() else []:
        rank, name, at, _modules, cpu = line.split()
        marks.setdefault(rank, {}).setdefault(name, (float(at), float(cpu)))
    return marks


def torch_import_s() -> float:
    """Seconds ``import torch`` takes in a fresh interpreter of this venv (the import alone, not the teardown)."""
    code = "import time; t = time.perf_counter(); import torch; print(time.perf_counter() - t)"
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def startup_parts(marks_file: Path, t0_wall: float, ready_wall: float, end_wall: float) -> list[tuple[str, float]]:
    """Rank 0's start-up split at the marks the ranks wrote, in seconds.

    ``t0_wall``: when ``start_kernel`` was called; ``ready_wall``: when ``wait_for_ready`` returned;
    ``end_wall``: when the first broadcast cell's reply came. Each part runs from the mark before to its own.
    """
    marks = {name: at for name, (at, _cpu) in read_marks(marks_file).get("0", {}).items()}
    parts, before = [], t0_wall
    for label, at in [*((label, marks.get(name)) for label, name in STARTUP_STEPS), (READY_STEP, ready_wall)]:
        if at is not None:
            parts.append((label, at - before))
            before = at
    parts.append(("first %%all cell", end_wall - before))
    return parts


def rank_lines(marks_file: Path, t0_wall: float) -> list[str]:
    """Every rank's marks: seconds after ``start_kernel`` and, in brackets, the CPU seconds the rank had used.

    A rank whose CPU seconds keep up with the wall clock was never waiting: its start-up is bound by its own work.
    """
    return [
        f"rank {r}: " + ", ".join(f"{name} {at - t0_wall:.2f} ({cpu:.2f})" for name, (at, cpu) in marks.items())
        for r, marks in sorted(read_marks(marks_file).items())
    ]


class Live:
    """One running kernel of one system."""

    def __init__(self, system: System, kernel_name: str, cell_timeout: float, log: Path):
        self.system = system
        self.log = log
        self.kernel_name = kernel_name
        self.cell_timeout = cell_timeout
        self.km = None
        self.kc = None
        self.shutdown_s: float | None = None  # seconds jupyter_client's shutdown_kernel(now=False) took

    def start(self, startup_timeout: float) -> dict:
        """Start, run the start-up cells and the first broadcast; return timings."""
        t0, t0_wall = time.perf_counter(), time.time()
        marks = self.log.with_suffix(".marks")
        marks.unlink(missing_ok=True)
        self.km = KernelManager(kernel_name=self.kernel_name)
        with open(self.log, "ab") as fh:  # kernel stdout/stderr (the child keeps its own fd)
            self.km.start_kernel(stdout=fh, stderr=fh, env={**os.environ, "SHARDBOOK_STARTUP_MARKS": str(marks)})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=startup_timeout)
        t_ready, ready_wall = time.perf_counter() - t0, time.time()
        for cell in self.system.startup_cells:
            run_ok(self.kc, cell, startup_timeout, self.system.error_re)
        run_ok(self.kc, self.system.broadcast(CELL_EMPTY), startup_timeout, self.system.error_re)
        parts = startup_parts(marks, t0_wall, ready_wall, time.time()) if marks.exists() else []
        ranks = rank_lines(marks, t0_wall) if marks.exists() else []
        return {"startup": time.perf_counter() - t0, "ready": t_ready, "parts": parts, "ranks": ranks}

    def prepare(self) -> None:
        for cell in self.system.rank_cells:
            run_ok(self.kc, cell, self.cell_timeout, self.system.error_re)

    def log_tail(self, n: int = 15) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        lines = [ln for ln in lines if "running over TCP without encryption" not in ln]
        return "\n".join("      | " + ln for ln in lines[-n:])

    def stop(self) -> None:
        procs = []
        if self.km is not None and self.km.has_kernel:
            pid = getattr(self.km.provisioner, "pid", None)
            if pid:
                procs = descendants(pid)
        if self.kc is not None:
            for cell in self.system.teardown_cells:
                try:
                    execute(self.kc, cell, 30)
                except Exception as e:
                    print(f"  [{self.system.key}] teardown {cell.splitlines()[0]!r}: {e}", flush=True)
            self.kc.stop_channels()
        if self.km is not None:
            try:
                t0 = time.perf_counter()
                self.km.shutdown_kernel(now=False)  # jupyter_client's SIGTERM comes 2.5 s in, a SIGKILL at 5 s
                self.shutdown_s = time.perf_counter() - t0
            except Exception as e:
                print(f"  [{self.system.key}] shutdown: {e}", flush=True)
        # Reap what this kernel started (by pid), e.g. torchrun followers or
        # ipyparallel/nbdistributed workers that outlive their parent.
        if psutil is not None and procs:
            alive = [p for p in procs if p.is_running()]
            for p in alive:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            _, alive = psutil.wait_procs(alive, timeout=5)
            for p in alive:
                try:
                    p.kill()
                except psutil.Error:
                    pass
            psutil.wait_procs(alive, timeout=5)


# --------------------------------------------------------------------------- #
# Statistics / report
# --------------------------------------------------------------------------- #
def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def ms(x: float) -> str:
    return "-" if x != x else f"{x * 1e3:.1f}"


def main(argv: list[str] | None = None) -> int:
    global ANCHORS_VENV
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--setup-anchors",
        action="store_true",
        help="create the anchors venv if missing, pip install -r bench/anchors/requirements.txt, exit",
    )
    ap.add_argument("--anchors-venv", type=Path, default=ANCHORS_VENV)
    ap.add_argument("--anchors-python", default="python3.11", help="python used to create the anchors venv")
    ap.add_argument(
        "--only", default="", help="comma-separated systems (default all): " + ",".join(s.key for s in SYSTEMS)
    )
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--big-runs", type=int, default=None, help="runs of the 1000-line cell (default --runs)")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--startup-reps", type=int, default=3, help="fresh starts per system for the start-up figure")
    ap.add_argument("--cell-timeout", type=float, default=120)
    ap.add_argument("--startup-timeout", type=float, default=180)
    ap.add_argument("--json", type=Path, help="also write the raw figures here")
    ap.add_argument("--keep-tmp", action="store_true", help="keep the temp dir (kernelspecs, kernel logs)")
    args = ap.parse_args(argv)
    ANCHORS_VENV = args.anchors_venv

    if args.setup_anchors:
        setup_anchors(ANCHORS_VENV, args.anchors_python)
        return 0

    wanted = [s for s in SYSTEMS if not args.only or s.key in args.only.split(",")]
    big_runs = args.runs if args.big_runs is None else args.big_runs
    tmp = Path(tempfile.mkdtemp(prefix="shardbook-bench-"))
    kernels_dir = tmp / "jupyter" / "kernels"
    kernels_dir.mkdir(parents=True)
    logs = tmp / "logs"
    logs.mkdir()
    os.environ["JUPYTER_PATH"] = str(tmp / "jupyter")
    os.environ["JUPYTER_RUNTIME_DIR"] = str(tmp / "runtime")
    os.environ["IPYTHONDIR"] = str(tmp / "ipython")  # fresh profile, no user startup files

    print(
        f"# shardbook kernel round trips (issue 2) — world {WORLD}, "
        f"{args.runs} runs ({big_runs} for {BIG_LINES} lines) after {args.warmup} warm-ups"
    )
    print(f"# python {sys.version.split()[0]} at {sys.executable}; anchors venv {ANCHORS_VENV}")
    systems: list[System] = []
    names: dict[str, str] = {}
    skipped: dict[str, str] = {}
    for s in wanted:
        try:
            spec = s.kernelspec(tmp)
        except Skip as e:
            skipped[s.key] = str(e)
            print(f"SKIP {s.key}: {e}")
            continue
        name = f"bench-{s.key}"
        (kernels_dir / name).mkdir(parents=True, exist_ok=True)
        (kernels_dir / name / "kernel.json").write_text(json.dumps(spec, indent=1))
        names[s.key] = name
        systems.append(s)
        print(f"  {s.key:20s} {s.how}")
        print(f"  {'':20s} argv: {' '.join(spec['argv'])}")

    results: dict[str, dict] = {s.key: {"startup": [], "ready": [], "shutdown": []} for s in systems}
    failed: dict[str, str] = {}
    start_fails: dict[str, list[str]] = {}  # failed start attempts (not fatal if a retry worked)
    start_tries: dict[str, int] = {}

    # ---- (4) start-up, each system alone ------------------------------------
    print("\n## start-up (each system started alone)", flush=True)
    torch_imports: list[float] = []
    for rep in range(args.startup_reps):
        for s in systems[rep % max(1, len(systems)) :] + systems[: rep % max(1, len(systems))]:
            if s.key in failed:
                continue
            live = Live(s, names[s.key], args.cell_timeout, logs / f"{s.key}-startup{rep}.log")
            start_tries[s.key] = start_tries.get(s.key, 0) + 1
            try:
                t = live.start(args.startup_timeout)
                results[s.key]["startup"].append(t["startup"])
                results[s.key]["ready"].append(t["ready"])
                print(
                    f"  {s.key:20s} start->first broadcast reply {t['startup']:.2f} s "
                    f"(kernel_info ready {t['ready']:.2f} s)",
                    flush=True,
                )
                for label, seconds in t["parts"]:
                    print(f"      {seconds:6.2f} s  {label}", flush=True)
                for line in t["ranks"]:
                    print(f"      {line}", flush=True)
            except Exception as e:
                start_fails.setdefault(s.key, []).append(str(e))
                print(f"  FAIL {s.key} start {rep + 1}: {e}\n{live.log_tail()}", flush=True)
            finally:
                live.stop()
                if live.shutdown_s is not None:
                    results[s.key]["shutdown"].append(live.shutdown_s)
        if "shardbook" in names:  # the reference for shardbook's start-up, taken between its starts
            torch_imports.append(torch_import_s())
            print(f"  {'import torch':20s} {torch_imports[-1]:.2f} s (a fresh interpreter, same moment)", flush=True)
    for key, errs in start_fails.items():
        if not results[key]["startup"]:
            failed[key] = f"start-up failed {len(errs)}/{args.startup_reps}: {errs[0]}"

    # ---- (1)-(3) steady state, all kernels live, interleaved ----------------
    print("\n## steady state (all kernels live, runs interleaved)", flush=True)
    lives: list[Live] = []
    try:
        for s in systems:
            if s.key in failed:
                continue
            for attempt in (1, 2):  # an anchor that flakes on start gets a second go
                live = Live(s, names[s.key], args.cell_timeout, logs / f"{s.key}-{attempt}.log")
                start_tries[s.key] = start_tries.get(s.key, 0) + 1
                try:
                    live.start(args.startup_timeout)
                    live.prepare()
                    lives.append(live)
                    break
                except Exception as e:
                    start_fails.setdefault(s.key, []).append(str(e))
                    print(f"  FAIL {s.key} start (attempt {attempt}): {e}\n{live.log_tail()}", flush=True)
                    live.stop()
                    if attempt == 2:
                        failed[s.key] = f"start/prepare: {e}"

        tests = [
            ("empty", CELL_EMPTY, args.runs, None),
            ("one_line", CELL_ONE, args.runs, 1),
            ("big", CELL_BIG, big_runs, BIG_LINES),
        ]
        for tname, body, runs, nlines in tests:
            for live in lives:
                results[live.system.key][tname] = []
                if nlines:
                    results[live.system.key][tname + "_verify"] = []
            for i in range(args.warmup + runs):
                k = i % max(1, len(lives))
                for live in lives[k:] + lives[:k]:
                    key = live.system.key
                    if key in failed:
                        continue
                    try:
                        res = run_ok(live.kc, live.system.broadcast(body), args.cell_timeout, live.system.error_re)
                    except Exception as e:
                        failed[key] = f"{tname}: {e}"
                        print(f"  FAIL {key} {tname}: {e}\n{live.log_tail()}", flush=True)
                        continue
                    if i < args.warmup:
                        continue
                    results[key][tname].append(res.seconds)
                    if nlines:
                        results[key][tname + "_verify"].append(verify_lines(live.system, res, nlines))
            print(f"  {tname}: done", flush=True)
    finally:
        for live in lives:
            live.stop()
        if failed or args.keep_tmp:
            print(f"# kernel logs kept in {logs}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    # ---- report --------------------------------------------------------------
    def med(key, t):
        return statistics.median(results[key][t]) if results.get(key, {}).get(t) else float("nan")

    def p90(key, t):
        return pct(results[key][t], 0.9) if results.get(key, {}).get(t) else float("nan")

    print("\n## results (ms; start-up and shutdown in s)")
    hdr = (
        f"{'system':20s} {'empty med':>9s} {'p90':>7s} {'1-line med':>10s} {'p90':>7s} "
        f"{'1000-line med':>13s} {'p90':>7s} {'lines ok':>9s} {'start-up s':>10s} {'shutdown s':>10s} "
        f"{'empty/floor':>11s}"
    )
    print(hdr)
    print("-" * len(hdr))
    floor_empty = med("floor", "empty") if "floor" in results else float("nan")
    summary = {}
    for s in systems:
        key = s.key
        if not results[key].get("empty") and key in failed:
            print(f"{key:20s} FAILED: {failed[key]}")
            continue
        ver = results[key].get("big_verify", [])
        ver1 = results[key].get("one_line_verify", [])
        nok = sum(v["ok"] for v in ver)
        su = statistics.median(results[key]["startup"]) if results[key]["startup"] else float("nan")
        down = statistics.median(results[key]["shutdown"]) if results[key]["shutdown"] else float("nan")
        ratio = med(key, "empty") / floor_empty if floor_empty == floor_empty else float("nan")
        print(
            f"{key:20s} {ms(med(key, 'empty')):>9s} {ms(p90(key, 'empty')):>7s} "
            f"{ms(med(key, 'one_line')):>10s} {ms(p90(key, 'one_line')):>7s} "
            f"{ms(med(key, 'big')):>13s} {ms(p90(key, 'big')):>7s} "
            f"{f'{nok}/{len(ver)}':>9s} {su:>10.2f} {down:>10.2f} {'-' if ratio != ratio else f'{ratio:.2f}x':>11s}"
        )
        summary[key] = {
            "empty_med_ms": med(key, "empty") * 1e3,
            "empty_p90_ms": p90(key, "empty") * 1e3,
            "one_line_med_ms": med(key, "one_line") * 1e3,
            "one_line_p90_ms": p90(key, "one_line") * 1e3,
            "big_med_ms": med(key, "big") * 1e3,
            "big_p90_ms": p90(key, "big") * 1e3,
            "big_verified": f"{nok}/{len(ver)}",
            "one_line_verified": f"{sum(v['ok'] for v in ver1)}/{len(ver1)}",
            "startup_s": su,
            "startup_all_s": results[key]["startup"],
            "shutdown_s": down,
            "start_failures": start_fails.get(key, []),
            "failed": failed.get(key),
        }
        bad = [v for v in ver + ver1 if not v["ok"]]
        if bad:
            print(f"{'':20s} line check failed in {len(bad)} runs, e.g. {bad[0]}")
        if ver and key != "floor":
            lab = ver[-1]["labelled"], ver[-1]["lines"]
            print(f"{'':20s} rank labels in its own output format matched {lab[0]}/{lab[1]} lines")
        if key in failed:
            print(f"{'':20s} (then failed: {failed[key]})")
        if start_fails.get(key):
            n = len(start_fails[key])
            print(f"{'':20s} {n} of {start_tries[key]} starts failed, e.g. {start_fails[key][0][:160]}")
    for key, why in skipped.items():
        print(f"{key:20s} SKIPPED: {why}")
    if torch_imports and "floor" in summary and "shardbook" in summary:
        torch_s, floor_s = statistics.median(torch_imports), summary["floor"]["startup_s"]
        print(
            f"\nshardbook start-up {summary['shardbook']['startup_s']:.2f} s against the floor's start-up plus one "
            f"`import torch` measured in this run: {floor_s:.2f} + {torch_s:.2f} = {floor_s + torch_s:.2f} s"
        )

    # side-by-side ratios against shardbook
    if "shardbook" in summary:
        print("\n## ratios, anchor / shardbook (>1: shardbook is faster)")
        for key, v in summary.items():
            if key in ("shardbook", "floor"):
                continue
            sb = summary["shardbook"]
            print(
                f"  {key:20s} empty {v['empty_med_ms'] / sb['empty_med_ms']:.2f}x  "
                f"1000-line {v['big_med_ms'] / sb['big_med_ms']:.2f}x  "
                f"start-up {v['startup_s'] / sb['startup_s']:.2f}x"
            )

    print("\n## targets (issue 2)")
    sb = summary.get("shardbook")
    anchors = {k: v for k, v in summary.items() if k not in ("floor", "shardbook")}
    if sb is None:
        why = skipped.get("shardbook") or failed.get("shardbook") or "not selected"
        print(f"SKIP all targets: shardbook not measured ({why})")
    else:
        if "floor" in summary:
            d = sb["empty_med_ms"] - summary["floor"]["empty_med_ms"]
            print(
                f"{'PASS' if d <= 3.0 else 'FAIL'} empty %%all within 3 ms of the plain-ipykernel floor: "
                f"{sb['empty_med_ms']:.1f} ms vs {summary['floor']['empty_med_ms']:.1f} ms (+{d:.1f} ms)"
            )
        else:
            print("SKIP empty %%all vs floor: floor not measured")
        good = {
            k: v
            for k, v in anchors.items()
            if v["big_verified"].split("/")[0] == v["big_verified"].split("/")[1] != "0"
        }
        if good:
            best = min(good, key=lambda k: good[k]["big_med_ms"])
            ok = (
                sb["big_med_ms"] <= good[best]["big_med_ms"]
                and sb["big_verified"].split("/")[0] == sb["big_verified"].split("/")[1]
            )
            print(
                f"{'PASS' if ok else 'FAIL'} {BIG_LINES}-line cell no slower than the best anchor ({best}): "
                f"{sb['big_med_ms']:.1f} ms vs {good[best]['big_med_ms']:.1f} ms, "
                f"shardbook lines verified {sb['big_verified']}"
            )
        else:
            print(f"SKIP {BIG_LINES}-line target: no anchor delivered all lines")
        if "ipyparallel" in anchors:
            ok = sb["startup_s"] <= anchors["ipyparallel"]["startup_s"]
            print(
                f"{'PASS' if ok else 'FAIL'} start-up no slower than ipyparallel: "
                f"{sb['startup_s']:.2f} s vs {anchors['ipyparallel']['startup_s']:.2f} s"
            )
        else:
            print("SKIP start-up target: ipyparallel not measured")

    if args.json:
        args.json.write_text(
            json.dumps(
                {"summary": summary, "skipped": skipped, "failed": failed, "raw": results}, indent=1, default=str
            )
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
