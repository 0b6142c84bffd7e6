"""Run by test_lm_eval.py in a process of its own, offline (the tasks and their data are local files): lm-eval's
`local-completions` multiple-choice task against `/v1/completions`, compared with ChatModel.score and with
lm-eval's own `hf` backend on the same model; a `generate_until` task through `local-chat-completions` at
`num_concurrent` 1 and 8. Prints one JSON line."""

import importlib
import json
import socket
import sys
import types

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardbook.rankd.commands.generate  # noqa
from shardbook.kernel.api.batch import scheduler_for
from shardbook.kernel.api.chat import ChatModel
from shardbook.kernel.ranks.runtime import get_runtime
from shardbook.kernel.server.server import Server
from shardbook.kernel.server.state import ServeOptions
from shardbook.rankd.config.schema import ModelConfig, ShardbookConfig

model_dir, task_dir = sys.argv[1], sys.argv[2]
torch.set_num_threads(1)
rt = get_runtime(shell=object())
m = AutoModelForCausalLM.from_pretrained(model_dir).eval()
t = AutoTokenizer.from_pretrained(model_dir)
rt.ctx0.state["loaded"] = types.SimpleNamespace(model=m, tokenizer=t, summary={})
rt.ctx0.state["config"] = ShardbookConfig(model=ModelConfig(model_name_or_path=model_dir, dtype="float32"))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = Server(rt, ServeOptions(port=port)).start()
lm_eval = importlib.import_module("lm_eval")
TaskManager = importlib.import_module("lm_eval.tasks").TaskManager

name = model_dir.rstrip("/").split("/")[-1]
url = f"http://127.0.0.1:{port}/v1"
tasks = TaskManager(include_path=task_dir, include_defaults=False)  # indexing lm-eval's own tasks costs ~20 s each


def evaluate(model: str, model_args: str, task: str, **kwargs) -> tuple[float, dict[int, dict]]:
    """The task's accuracy (or exact match) and its samples by doc id."""
    res = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task],
        task_manager=tasks,
        log_samples=True,
        **kwargs,
    )
    metrics = res["results"][task]
    score = metrics.get("acc,none", metrics.get("exact_match,none"))
    return score, {s["doc_id"]: s for s in res["samples"][task]}


def loglikelihoods(sample: dict) -> list[float]:
    return [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in sample["filtered_resps"]]


served = f"model={name},base_url={url}/completions,tokenizer_backend=huggingface,tokenizer={model_dir},max_retries=1"
acc, samples = evaluate("local-completions", served + ",num_concurrent=4", "capitals_local")
chat = ChatModel(rt)
agree = True
for s in samples.values():
    pairs = [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a) for a in s["arguments"]]
    ours = [chat.score(c, [x])[0] for c, x in pairs]
    agree = agree and all(abs(a - b) < 1e-3 for a, b in zip(loglikelihoods(s), ours))
hf_acc, hf_samples = evaluate("hf", f"pretrained={model_dir},dtype=float32,device=cpu", "capitals_local")
hf_diff = max(abs(a - b) for d, s in samples.items() for a, b in zip(loglikelihoods(s), loglikelihoods(hf_samples[d])))
chat_args = f"model={name},base_url={url}/chat/completions,max_retries=1,num_concurrent="
answers, largest = {}, {}
for concurrent in (1, 8):
    scheduler_for(rt).stats["largest_batch"] = 0
    _, generated = evaluate(
        "local-chat-completions", chat_args + str(concurrent), "say_local", apply_chat_template=True
    )
    answers[concurrent] = [generated[d]["resps"][0][0] for d in sorted(generated)]
    largest[concurrent] = scheduler_for(rt).stats["largest_batch"]
found = {
    "acc": acc,
    "n": len(samples),
    "agree": agree,
    "hf_acc": hf_acc,
    "hf_max_diff": hf_diff,
    "generated_n": len(answers[1]),
    "generated_nonempty": all(answers[1]),
    "concurrent_equal": answers[1] == answers[8],
    "largest_batch": largest,
}
print(json.dumps(found))
server.stop()
