"""Run by test_batch_serving.py in a process of its own (a world of one rank with a process-wide runtime):
the HTTP server over the continuous batch, driven with the openai client. Prints one JSON line of findings."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def one_rank_serving(model, tokenizer, model_path: str):
    """This process's runtime (rank 0 of a world of one) holding `model` as the loaded model, a free port for a
    server, and an openai client for that port: what every in-process serving check starts from."""
    import openai

    import shardbook.rankd.commands.generate  # noqa: F401  (registers the batch handler)
    from shardbook.kernel.ranks.runtime import get_runtime
    from shardbook.rankd.config.schema import ModelConfig, ShardbookConfig

    torch.set_num_threads(1)
    runtime = get_runtime(shell=object())
    runtime.ctx0.state["loaded"] = types.SimpleNamespace(model=model, tokenizer=tokenizer, summary={})
    runtime.ctx0.state["config"] = ShardbookConfig(model=ModelConfig(model_name_or_path=model_path, dtype="float32"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
    return runtime, port, client


def main(model_dir: str, unbatched_dir: str) -> None:
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import shardbook.rankd.commands.generate  # noqa: F401  (registers the batch handler)
    from shardbook.kernel.api.chat import ChatModel
    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    runtime, port, client = one_rank_serving(model, tokenizer, model_dir)
    server = Server(runtime, ServeOptions(port=port, max_waiting=4)).start()
    name = Path(model_dir).name
    out: dict = {}

    prompt = "The capital of France is Paris."
    scored = client.completions.create(model=name, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    lp = scored.choices[0].logprobs
    ids = tokenizer(prompt)["input_ids"]
    with torch.no_grad():
        reference = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    expected = [None] + [reference[i - 1, ids[i]].item() for i in range(1, len(ids))]
    out["echo_text"] = scored.choices[0].text == prompt
    out["echo_max_diff"] = max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected[1:]))
    out["echo_first_none"] = lp.token_logprobs[0] is None
    out["echo_lengths"] = [len(lp.tokens), len(lp.top_logprobs), len(lp.text_offset), len(ids)]
    out["score_matches"] = abs(
        ChatModel(runtime).score("The capital of France is", [" Paris."])[0]
        - sum(lp.token_logprobs[-len(tokenizer(" Paris.", add_special_tokens=False)["input_ids"]) :])
    )

    chat = ChatModel(runtime)
    many = chat.generate_many(["Hello", "What is the capital of France?"], max_new_tokens=6, do_sample=False)
    single = [chat.chat(p, max_new_tokens=6, do_sample=False).text for p in ["Hello", "What is the capital of France?"]]
    out["generate_many_equals_chat"] = [r.text for r in many] == single
    joined = chat.chat("Hello", batch=True, max_new_tokens=6, do_sample=False, want_scores=True)
    sampled_twice = [chat.chat("Hello", batch=True, max_new_tokens=6, do_sample=True, seed=3).text for _ in range(2)]
    out["batch_chat"] = (
        joined.text == single[0]
        and joined.generated_tokens == len(joined.scores)
        and sampled_twice[0] == sampled_twice[1]
    )

    import tempfile

    from shardbook.kernel.api.batch import sequence_request
    from shardbook.magics.generate import read_prompts, run_to_file

    with tempfile.TemporaryDirectory() as tmp:
        source, target = Path(tmp) / "in.jsonl", Path(tmp) / "out.jsonl"
        lines = [
            '"Hello"',
            '{"prompt": "What is the capital of France?"}',
            '{"messages": [{"role": "user", "content": "Hello"}]}',
        ]
        source.write_text("\n".join(lines) + "\n")
        prompts = read_prompts(source)
        run_to_file(
            runtime,
            [sequence_request(runtime, p, chat=True, max_new_tokens=6, do_sample=False) for p in prompts],
            target,
        )
        rows = sorted((json.loads(x) for x in target.read_text().splitlines()), key=lambda r: r["index"])
        out["generate_file"] = [r["text"] for r in rows] == [single[0], single[1], single[0]]

    greedy = dict(model=name, max_tokens=8, temperature=0)
    prompts = ["Hello", "What is", "Numbers: 0 1", "def add(a, b):"]
    alone = [client.completions.create(prompt=p, **greedy).choices[0].text for p in prompts]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(lambda p: client.completions.create(prompt=p, **greedy).choices[0].text, prompts))
    out["concurrent_equal_alone"] = together == alone
    many = client.completions.create(prompt=prompts, n=2, **greedy)
    out["list_prompt_n"] = [c.text for c in many.choices] == [t for t in alone for _ in range(2)]
    ids_prompt = client.completions.create(prompt=tokenizer("Hello")["input_ids"], **greedy).choices[0].text
    out["token_prompt"] = ids_prompt == alone[0]
    sampled = dict(model=name, prompt="Hello", max_tokens=8, temperature=1.0, seed=5)
    first, second = (client.completions.create(**sampled).choices[0].text for _ in range(2))
    out["seeded"] = first == second
    stream = client.completions.create(prompt="Hello", stream=True, **greedy)
    out["stream_equal"] = "".join(c.choices[0].text for c in stream if c.choices) == alone[0]
    out["stream_logprobs_equal"] = all(stream_matches_whole(client, name, echo) for echo in (False, True))

    with ThreadPoolExecutor(16) as pool:
        statuses = list(
            pool.map(
                lambda i: (
                    requests.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": name, "prompt": f"Hello {i}", "max_tokens": 4, "temperature": 0},
                        timeout=120,
                    ).status_code
                ),
                range(40),
            )
        )
    out["statuses"] = sorted(set(statuses))
    out["answered"] = statuses.count(200)
    metrics = requests.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    out["metrics"] = all(
        k in metrics for k in ("shardbook_time_to_first_token_seconds_bucket", "shardbook_generation_tokens_total")
    )
    bad = requests.post(
        f"http://127.0.0.1:{port}/v1/completions", json={"model": name, "prompt": "x" * 3000, "max_tokens": 1}
    )
    out["too_long"] = bad.status_code
    server.stop()

    server = Server(runtime, ServeOptions(port=port, max_waiting=2)).start()
    rss_before = psutil.Process().memory_info().rss
    with ThreadPoolExecutor(64) as pool:
        codes = list(
            pool.map(
                lambda i: (
                    requests.post(
                        f"http://127.0.0.1:{port}/v1/completions",
                        json={"model": name, "prompt": f"Numbers {i}", "max_tokens": 12, "temperature": 0},
                        timeout=240,
                    ).status_code
                ),
                range(200),
            )
        )
    out["burst_statuses"] = sorted(set(codes))
    out["burst_answered"] = codes.count(200)
    out["burst_refused"] = codes.count(429)
    out["burst_rss_growth_mib"] = (psutil.Process().memory_info().rss - rss_before) / 2**20
    server.stop()

    server = Server(runtime, ServeOptions(port=port)).start()  # chat completions batch by default
    messages = [[{"role": "user", "content": q}] for q in ("Hello", "What is the capital of France?", "Numbers")]
    args = dict(model=name, max_tokens=8, temperature=0)
    alone = [client.chat.completions.create(messages=m, **args).choices[0].message.content for m in messages]
    with ThreadPoolExecutor(3) as pool:
        together = list(
            pool.map(lambda m: client.chat.completions.create(messages=m, **args).choices[0].message.content, messages)
        )
    out["chat_concurrent_equal_alone"] = together == alone
    out["chat_equals_single_path"] = alone[0] == chat.chat("Hello", max_new_tokens=8, do_sample=False).text
    two = client.chat.completions.create(messages=messages[0], n=2, logprobs=True, top_logprobs=2, **args)
    content = two.choices[0].logprobs.content
    out["chat_n_logprobs"] = (
        len(two.choices) == 2
        and two.choices[1].message.content == alone[0]
        and all(abs(c.logprob - c.top_logprobs[0].logprob) < 1e-6 for c in content)
    )
    lp = dict(logprobs=True, top_logprobs=2)
    whole = client.chat.completions.create(messages=messages[1], **lp, **args).choices[0].logprobs.content
    pieces = client.chat.completions.create(messages=messages[1], stream=True, **lp, **args)
    parts = [
        t.model_dump() for c in pieces if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content
    ]
    out["chat_stream_logprobs_equal"] = len(parts) == 8 and parts == [t.model_dump() for t in whole]
    streamed = client.chat.completions.create(messages=messages[1], stream=True, **args)
    out["chat_stream_equal"] = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == alone[1]

    out["model_changed"] = queued_across_a_load(runtime, port, name, messages[0])
    out["kv_budget_refuses"] = kv_budget_refuses(runtime, server, name)
    out["refused_model_takes_turns"] = refused_model_takes_turns(runtime, server, name, messages[0], unbatched_dir)
    out["stop_spares_the_notebook"] = stop_spares_the_notebook(runtime, server, name)  # stops the server
    out["defaults_take_32"] = defaults_take_32(runtime, port, name)

    server = Server(runtime, ServeOptions(port=port, batch=False)).start()  # --no-batch: one at a time
    turns = client.chat.completions.create(messages=messages[0], **args)
    out["no_batch_equal"] = turns.choices[0].message.content == alone[0]
    refused = requests.post(
        f"http://127.0.0.1:{port}/v1/chat/completions", json={**args, "messages": messages[0], "n": 2}
    )
    out["no_batch_refuses_n"] = refused.status_code == 400 and refused.json()["error"]["param"] == "n"
    server.stop()
    print(json.dumps(out))


def queued_across_a_load(runtime, port: int, name: str, messages: list) -> bool:
    """A chat request waiting to join the batch while another model is loaded gets a 409, never the new model."""
    import requests

    from shardbook.kernel.api.batch import scheduler_for

    load = runtime.generation_queue.enter("load")  # %load_sharded holds the ranks
    assert load.wait()
    replies = []
    body = {"model": name, "messages": messages, "max_tokens": 2}
    url = f"http://127.0.0.1:{port}/v1/chat/completions"
    waiting = threading.Thread(target=lambda: replies.append(requests.post(url, json=body, timeout=60)))
    waiting.start()
    deadline = time.monotonic() + 30
    while scheduler_for(runtime).occupancy()[1] != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    old = runtime.ctx0.state["loaded"]
    runtime.ctx0.state["loaded"] = types.SimpleNamespace(model=old.model, tokenizer=old.tokenizer, summary={})  # reload
    load.finish()
    waiting.join(60)
    error = replies[0].json().get("error", {})
    served = requests.post(url, json=body, timeout=60).status_code  # the new model answers a new request
    return replies[0].status_code == 409 and error.get("code") == "model_changed" and served == 200


def defaults_take_32(runtime, port: int, name: str) -> list[int]:
    """The statuses of 32 requests sent at once to a server with the default limits, all in line together (the
    batch held back by another turn until they wait) before any is decoded."""
    import requests

    from shardbook.kernel.api.batch import scheduler_for
    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    server = Server(runtime, ServeOptions(port=port)).start()
    hold = runtime.generation_queue.enter("load")
    assert hold.wait()
    body = {"model": name, "prompt": "Numbers", "max_tokens": 2, "temperature": 0}
    url = f"http://127.0.0.1:{port}/v1/completions"
    try:
        with ThreadPoolExecutor(32) as pool:
            replies = [pool.submit(requests.post, url, json=body, timeout=120) for _ in range(32)]
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline:
                refused = sum(reply.done() for reply in replies)
                if scheduler_for(runtime).occupancy()[1] + refused >= 32:
                    break
                time.sleep(0.05)
            hold.finish()
            return [reply.result().status_code for reply in replies]
    finally:
        hold.finish()  # does nothing once finished
        server.stop()


def kv_budget_refuses(runtime, server, name: str) -> bool:
    """Loaded with the KV cache budget a load measures where a rank has room for 100 tokens of cache: a request
    whose prompt and max_tokens need more is a 400 naming the budget before any forward; a smaller one runs."""
    import requests

    from shardbook.rankd.loading.summary import KV_CACHE_SHARE, kv_cache_figures

    old = runtime.ctx0.state["loaded"]
    per_token = kv_cache_figures(old.model, [0], None)["kv_cache_bytes_per_token"][0]
    summary = kv_cache_figures(old.model, [int(100 * per_token / KV_CACHE_SHARE)], None)
    runtime.ctx0.state["loaded"] = types.SimpleNamespace(model=old.model, tokenizer=old.tokenizer, summary=summary)
    forwards: list[int] = []
    hook = old.model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        body = {"model": name, "prompt": "Numbers: 0 1", "max_tokens": 120}
        too_big = requests.post(f"{server.url}/completions", json=body, timeout=60)
        ran = len(forwards)
        fits = requests.post(f"{server.url}/completions", json={**body, "max_tokens": 8}, timeout=60)
    finally:
        hook.remove()
        runtime.ctx0.state["loaded"] = old
    message = too_big.json().get("error", {}).get("message", "")
    return (
        summary["kv_cache_tokens"] == 100
        and (too_big.status_code, ran, fits.status_code) == (400, 0, 200)
        and "tokens of KV cache, but the batch may hold 100 (50% of rank 0's free memory" in message
    )


def refused_model_takes_turns(runtime, server, name: str, messages: list, unbatched_dir: str) -> bool:
    """After a load, while the server runs, of a model whose cache the batch cannot hold (Llama 4's
    chunked attention), chat requests take turns on the single path and /v1/completions is a clear 501."""
    import requests
    from transformers import AutoModelForCausalLM, AutoTokenizer

    old = runtime.ctx0.state["loaded"]
    model, tokenizer = (
        AutoModelForCausalLM.from_pretrained(unbatched_dir).eval(),
        AutoTokenizer.from_pretrained(unbatched_dir),
    )
    runtime.ctx0.state["loaded"] = types.SimpleNamespace(model=model, tokenizer=tokenizer, summary={})
    try:
        chat = requests.post(
            f"{server.url}/chat/completions", json={"model": name, "messages": messages, "max_tokens": 4}, timeout=60
        )
        text = requests.post(f"{server.url}/completions", json={"model": name, "prompt": "Hi"}, timeout=60)
        status = server.status_text()
    finally:
        runtime.ctx0.state["loaded"] = old
    refused = text.json().get("error", {})
    return (
        chat.status_code == 200
        and bool(chat.json()["choices"][0]["message"]["content"])
        and (text.status_code, refused.get("code")) == (501, "batch_unsupported")
        and "chat completions: one at a time (continuous batching cannot hold chunked attention" in status
    )


def stop_spares_the_notebook(runtime, server, name: str) -> bool:
    """Stopping the server ends its own streamed reply (with [DONE]) and leaves a notebook's sequence decoding in
    the same batch running to its end."""
    import requests

    from shardbook.kernel.api.batch import sequence_request, submit

    notebook_started, http_started, lines = threading.Event(), threading.Event(), []
    settings = dict(max_new_tokens=150, ignore_eos=True, do_sample=False)
    notebook = submit(
        runtime, sequence_request(runtime, "Hello", chat=False, **settings), on_text=lambda _: notebook_started.set()
    )
    body = {"model": name, "prompt": "Numbers: 0 1", "max_tokens": 150, "ignore_eos": True, "stream": True}

    def read() -> None:
        with requests.post(f"{server.url}/completions", json=body, stream=True, timeout=60) as reply:
            for line in reply.iter_lines():
                lines.append(line.decode())
                http_started.set()

    reader = threading.Thread(target=read)
    reader.start()
    assert notebook_started.wait(60) and http_started.wait(60)
    server.stop()
    reader.join(60)
    result = notebook.wait(60)
    events = [line for line in lines if line.startswith("data: ")]
    return (
        events[-1] == "data: [DONE]"
        and len(events) < 150  # the server's reply was cut short
        and (result.finish_reason, result.generated_tokens) == ("length", 150)
    )


def stream_matches_whole(client, name: str, echo: bool) -> bool:
    """A streamed completion with `logprobs` (and `echo`) joins into the whole reply: text and every list."""
    fields = dict(model=name, prompt="Numbers: 0 1", max_tokens=6, temperature=0, logprobs=2, echo=echo)
    whole = client.completions.create(**fields).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(stream=True, **fields) if c.choices]
    joined = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
    for chunk in chunks:
        for key in joined:
            joined[key] += getattr(chunk.logprobs, key) if chunk.logprobs else []
    expected = {key: getattr(whole.logprobs, key) for key in joined}
    return "".join(c.text for c in chunks) == whole.text and joined == expected and len(joined["tokens"]) > 6 * echo


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
