"""``bench/gpu_check.py --dry``: the GPU check's every stage on CPU with a tiny model, so it stays runnable."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(330)
ROOT = Path(__file__).resolve().parents[2]
SERVING = ["load", "chat", "clients 1", "clients 2"]
CAPTURE = ["eager", "cuda graph", "compile", "compile + cuda graphs"]
FP8 = ["fp8 kept", "fp8 kept experts"]


def test_dry_run_prints_every_row_and_measures_shardbook(tmp_path):
    rows_file = tmp_path / "rows.json"
    done = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu_check.py"), "--dry", "--json", str(rows_file)],
        capture_output=True,
        text=True,
        timeout=320,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    rows = json.loads(rows_file.read_text())
    expected = [("env", "-"), ("model", "-")]
    expected += [(stage, system) for system in ("shardbook", "vllm") for stage in SERVING]
    expected += [(check, "shardbook") for check in CAPTURE + FP8]
    assert [(r["stage"], r["system"]) for r in rows] == expected
    table = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert len(table) == 1 + len(expected)  # the header and one line per row: the same shape as the GPU run's
    status = {(r["stage"], r["system"]): r for r in rows}
    ok = [("env", "-"), ("model", "-"), *((s, "shardbook") for s in SERVING), ("eager", "shardbook")]
    ok.append(("compile", "shardbook"))
    assert all(status[key]["status"] == "ok" for key in ok), {k: status[k] for k in ok}
    assert "2/2 served" in status[("clients 2", "shardbook")]["result"]
    fp8 = status[("fp8 kept", "shardbook")]  # the reference path on a CPU, beside the dequantized load
    assert fp8["status"] == "ok" and fp8["result"].startswith("dequantize: weights"), fp8
    assert "; keep-reference (14 layers FP8, 0 by torch's FP8 matmul): weights" in fp8["result"], fp8
    experts = status[("fp8 kept experts", "shardbook")]  # gpu_fp8.py --moe: the routed experts kept as well
    assert experts["status"] == "ok" and experts["result"].startswith("dequantize: weights"), experts
    kept = "; keep-reference (8 layers FP8, 0 by torch's FP8 matmul; 4 expert tensors FP8, 0 by torch's FP8 matmul)"
    assert kept in experts["result"], experts
    assert status[("cuda graph", "shardbook")]["result"].startswith("no CUDA device")
    for stage in SERVING:  # vLLM is not installed beside CI's torch; a dry run never starts it
        assert status[(stage, "vllm")]["status"] == "skipped"
