"""Prompts longer than a step (`inference.max_step_tokens` 16) in every path of a real 2-rank kernel (`tp`):
`%%chat` (the batch, and `--no-batch`), `%generate`, and `%serve`'s two endpoints. None is refused: the batch
prefills each in chunks (counted in its steps), and `%%chat`'s batched reply equals its `--no-batch` one."""

from __future__ import annotations

import json
import math
import re

import pytest

from tests.e2e.http_helpers import chat, request, server_url
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)

MODEL = "paper-reader"
STEP_TOKENS = 16
LONG = " ".join(["The quick brown fox jumps over the lazy dog while the cat sleeps."] * 6)
STEPS = (  # a scheduler left by an earlier test's model (the kernel is the session's) has not counted ours
    "from shardbook.kernel.ranks.runtime import get_runtime\n"
    "state = get_runtime(get_ipython()).ctx0.state\n"
    "s = state.get('batch_scheduler')\n"
    "print(s.stats['steps'] if s and s.loaded is state.get('loaded') else 0)"
)


@pytest.fixture(scope="module")
def loaded(kernel, tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("long") / MODEL, max_position_embeddings=1024)
    ex = kernel.run(
        f"%load_sharded --model.model_name_or_path {path} --inference.system_prompt none --parallel.decode tp "
        f"--inference.max_step_tokens {STEP_TOKENS}",
        timeout=120,
    )
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    return kernel


def steps(kernel) -> int:
    return int(kernel.run(STEPS).stdout())


def test_a_prompt_longer_than_a_step_is_taken_by_every_path(loaded, tmp_path):
    before = steps(loaded)
    cell = f"%%chat --new --output text --max-new-tokens 6\n{LONG}"
    batched = loaded.run(cell)
    assert batched.status == "ok", batched.error_text() + batched.stderr()
    prompt_tokens = int(re.search(r"\[(\d+) prompt tokens", batched.stdout()).group(1))
    assert prompt_tokens > 10 * STEP_TOKENS
    # a chunk of at most a step's tokens per step, then a step per generated token after the first
    assert steps(loaded) - before >= math.ceil(prompt_tokens / STEP_TOKENS) + 5
    solo = loaded.run(cell.replace("--new", "--new --no-batch"))
    assert solo.status == "ok", solo.error_text()
    assert batched.stdout().rsplit("\n[", 1)[0] == solo.stdout().rsplit("\n[", 1)[0]

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(json.dumps({"prompt": LONG}) + '\n"Hello"\n')
    ex = loaded.run(f"%generate --in {source} --out {target} --max-new-tokens 4", timeout=120)
    assert ex.status == "ok", ex.error_text()
    rows = sorted((json.loads(line) for line in target.read_text().splitlines()), key=lambda r: r["index"])
    assert [r["generated_tokens"] for r in rows] == [4, 4] and rows[0]["prompt_tokens"] > 10 * STEP_TOKENS

    ex = loaded.run("%serve --port 0")
    assert ex.status == "ok", ex.error_text()
    try:
        url = server_url(ex.stdout())
        chatted = chat(url, MODEL, LONG, max_tokens=4)
        assert chatted.status == 200, chatted.body
        assert chatted.body["usage"]["prompt_tokens"] > 10 * STEP_TOKENS
        completed = request(url, "POST", "/v1/completions", {"model": MODEL, "prompt": LONG, "max_tokens": 4})
        assert completed.status == 200, completed.body
        assert completed.body["usage"]["prompt_tokens"] > 10 * STEP_TOKENS
        assert completed.body["choices"][0]["finish_reason"] == "length"
    finally:
        assert loaded.run("%serve --stop").status == "ok"
