"""guidellm (a load generator for OpenAI servers) as a real client of ``shardbook serve --nproc 2``: a short
synthetic load, offline, at 1 and 4 concurrent streams with its default request settings, and no failed request."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from shardbook.kernel.api.fetch import demo_model_dir, is_built
from tests.e2e.test_terminal_serve import ROOT, Served

SMOLLM2 = demo_model_dir("smollm2-135m-instruct")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(420),
    pytest.mark.skipif(not is_built(SMOLLM2), reason=f"demo model not built at {SMOLLM2}"),
    pytest.mark.skipif(shutil.which("guidellm", path=str(Path(sys.executable).parent)) is None, reason="no guidellm"),
]
REQUESTS = 4


def test_guidellm_synthetic_load_at_1_and_4_streams_has_no_failed_request(tmp_path):
    served = Served(ROOT / "configs" / "smollm2-135m.yaml")
    try:
        report = tmp_path / "report.json"
        argv = [
            str(Path(sys.executable).parent / "guidellm"),
            "run",
            "--backend",
            f"kind=openai_http,target={served.url.removesuffix('/v1')}",
            "--profile",
            "kind=concurrent,streams=1",
            "--override",
            "profile.streams",
            "1,4",
            "--constraint",
            f"kind=max_requests,count={REQUESTS}",
            "--data",
            "kind=synthetic_text,prompt_tokens=32,output_tokens=16",
            "--tokenizer",
            f"kind=huggingface_auto,model={SMOLLM2}",
            "--output",
            f"kind=json,path={report}",
            "--disable-console-interactive",
        ]
        offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        done = subprocess.run(
            argv, capture_output=True, text=True, timeout=360, cwd=tmp_path, env={**os.environ, **offline}
        )
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        benchmarks = json.loads(report.read_text())["benchmarks"]
        streams = [b["config"]["strategy"]["streams"] for b in benchmarks]
        totals = [b["scheduler_state"] for b in benchmarks]
        assert streams == [1, 4], streams
        # no request failed; guidellm's request limit may cancel the last one still in flight when it is reached
        assert all(t["errored_requests"] == 0 for t in totals), totals
        assert all(REQUESTS - 1 <= t["successful_requests"] <= REQUESTS for t in totals), totals
    finally:
        assert served.stop(signal.SIGTERM) == 0, "".join(served.stderr)
