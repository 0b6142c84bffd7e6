"""Continuous batching in a real 2-rank kernel: `%%chat` (batched by default), `ChatModel.generate_many`,
`ChatModel.score` and `%generate`, each running the `batch` command over the control plane."""

from __future__ import annotations

import json

import pytest

from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(300)
STEPS = (
    "from shardbook.kernel.ranks.runtime import get_runtime\n"
    "print(get_runtime(get_ipython()).ctx0.state['batch_scheduler'].stats['steps'])"
)


@pytest.fixture(scope="module")
def loaded(kernel, tmp_path_factory):
    tiny = make_tiny_llama(tmp_path_factory.mktemp("batching") / "llama")
    ex = kernel.run(
        f"%load_sharded --model.model_name_or_path {tiny} --inference.system_prompt none --parallel.decode tp",
        timeout=120,
    )
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    return kernel


def test_chat_batch_generate_many_score_and_generate_file(loaded, tmp_path):
    cell = "%%chat --new --output text --max-new-tokens 12\nWhat is the capital of France?"
    solo = loaded.run(cell.replace("--new", "--new --no-batch"))
    assert solo.status == "ok", solo.error_text()
    batched = loaded.run(cell)
    assert batched.status == "ok", batched.error_text() + batched.stderr()
    assert batched.stdout().rsplit("\n[", 1)[0] == solo.stdout().rsplit("\n[", 1)[0]
    assert int(loaded.run(STEPS).stdout()) > 0  # plain %%chat ran in the batch; --no-batch did not

    code = (
        "from shardbook.kernel import ChatModel\n"
        "m = ChatModel()\n"
        "qs = ['What is the capital of France?', 'Hello', 'Numbers: 0 1 2']\n"
        "many = [r.text for r in m.generate_many(qs, max_new_tokens=10, do_sample=False)]\n"
        "alone = [m.chat(q, max_new_tokens=10, do_sample=False).text for q in qs]\n"
        "print(many == alone)\n"
        "s = m.score('The capital of France is', [' Paris.', ' the dog'])\n"
        "print(len(s) == 2 and all(x < 0 for x in s))\n"
    )
    ex = loaded.run(code, timeout=120)
    assert ex.status == "ok", ex.error_text()
    assert ex.stdout().split() == ["True", "True"]

    source, target = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('"Hello"\n{"prompt": "What is the capital of France?"}\n')
    ex = loaded.run(f"%generate --in {source} --out {target} --max-new-tokens 6", timeout=120)
    assert ex.status == "ok", ex.error_text()
    rows = [json.loads(line) for line in target.read_text().splitlines()]
    assert sorted(r["index"] for r in rows) == [0, 1]
