"""lm-eval against the server, offline: `local-completions` (log-likelihood, multiple choice) against
`/v1/completions` equal to lm-eval's `hf` backend, and `local-chat-completions` (`generate_until`) whose answers
do not depend on `num_concurrent`."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from checks import run_check
from tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(480)

TASK = """task: capitals_local
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""
GENERATE_TASK = """task: {name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "{{{{question}}}}"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["\\n\\n"]
  max_gen_toks: {max_gen_toks}
  do_sample: false
{more}metric_list:
  - metric: exact_match
"""
"""A generate_until task over the JSON lines at `data`; `more` adds lines to its generation_kwargs."""
DOCS = [
    {"question": "The capital of France is", "choices": ["Paris.", "Rome.", "the dog"], "answer": 0},
    {"question": "The quick brown fox jumps over the", "choices": ["lazy dog", "capital", "42"], "answer": 0},
    {"question": "Numbers: 0 1 2", "choices": ["3 4", "fox", "Paris"], "answer": 0},
]


def test_lm_eval_log_likelihoods_equal_hf_and_generations_do_not_depend_on_concurrency(tmp_path: Path) -> None:
    pytest.importorskip("lm_eval")
    pytest.importorskip("tenacity")
    model = make_tiny_llama(tmp_path / "tiny", hidden_size=72, num_heads=9, num_kv_heads=3)
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (tasks / "capitals_local.yaml").write_text(TASK.format(data=data))
    (tasks / "say_local.yaml").write_text(GENERATE_TASK.format(name="say_local", data=data, max_gen_toks=8, more=""))
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_CACHE": str(tmp_path / "datasets")}
    found = run_check(Path(__file__).with_name("lm_eval_check.py"), model, tasks, timeout=450, env=env)
    assert found["n"] == 3 and found["agree"]  # lm-eval's numbers are ChatModel.score's, request by request
    assert found["hf_max_diff"] < 1e-3 and found["acc"] == found["hf_acc"]  # and those of lm-eval's hf backend
    assert found["generated_n"] == 3 and found["generated_nonempty"]
    assert found["concurrent_equal"] and found["largest_batch"] == {"1": 1, "8": 3}  # 8 decode together
