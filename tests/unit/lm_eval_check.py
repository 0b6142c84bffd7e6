"""Run by test_lm_eval.py in a process of its own: lm-eval's `local-completions` multiple-choice task against
the server's `/v1/completions`, offline (the task and its data are local files). Prints one JSON line."""

import importlib
import json
import socket
import sys
import types

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import shardbook.rankd.commands.generate  # noqa
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
rt.ctx0.state["loaded"] = types.SimpleNamespace(model=m, tokenizer=t)
rt.ctx0.state["config"] = ShardbookConfig(model=ModelConfig(model_name_or_path=model_dir, dtype="float32"))
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
server = Server(rt, ServeOptions(port=port)).start()
lm_eval = importlib.import_module("lm_eval")
TaskManager = importlib.import_module("lm_eval.tasks").TaskManager

name = model_dir.rstrip("/").split("/")[-1]
res = lm_eval.simple_evaluate(
    model="local-completions",
    model_args=(
        f"model={name},base_url=http://127.0.0.1:{port}/v1/completions,tokenizer_backend=huggingface,"
        f"tokenizer={model_dir},num_concurrent=4,max_retries=1"
    ),
    tasks=["capitals_local"],
    task_manager=TaskManager(include_path=task_dir),
    log_samples=True,
)
samples = res["samples"]["capitals_local"]
chat = ChatModel(rt)
agree = True
for s in samples:
    doc = s["doc"]
    theirs = [r[0][0] if isinstance(r[0], (list, tuple)) else r[0] for r in s["filtered_resps"]]
    pairs = [a for a in s["arguments"]]
    pairs = [(a["arg_0"], a["arg_1"]) if isinstance(a, dict) else tuple(a) for a in pairs]
    ours = [chat.score(c, [x])[0] for c, x in pairs]
    agree = agree and all(abs(a - b) < 1e-3 for a, b in zip(theirs, ours))
print(json.dumps({"acc": res["results"]["capitals_local"]["acc,none"], "n": len(samples), "agree": agree}))
server.stop()
