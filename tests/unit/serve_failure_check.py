"""Run by test_serve_failures.py in a process of its own (a world of one rank with a process-wide runtime):
generation that really fails mid-reply (the model's forward raises after a few steps, as a rank dying in a
collective makes it raise), seen through the openai client on the batch and on ``--no-batch``. Prints one
JSON line of findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
FAIL_AFTER = 4
"""Forward calls that succeed once armed (the prefill and three decode steps): then every call raises."""


class FailingForward:
    """The model's forward, raising ``RuntimeError`` once armed and past ``FAIL_AFTER`` calls."""

    def __init__(self, forward):
        self.forward, self.calls, self.armed = forward, 0, False

    def __call__(self, *args, **kwargs):
        if self.armed:
            self.calls += 1
            if self.calls > FAIL_AFTER:
                raise RuntimeError("injected failure: the forward broke mid-reply")
        return self.forward(*args, **kwargs)

    def arm(self) -> None:
        self.calls, self.armed = 0, True


def main(model_dir: str) -> None:
    from batch_server_check import one_rank_serving  # a sibling script: this one runs as a file too
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    failing = FailingForward(model.forward)
    model.forward = failing
    runtime, port, client = one_rank_serving(model, AutoTokenizer.from_pretrained(model_dir), model_dir)
    name = Path(model_dir).name
    ask = dict(model=name, messages=[{"role": "user", "content": "Hello"}], max_tokens=40, temperature=0)
    out: dict = {}
    for batch in (True, False):
        path = "batch" if batch else "no_batch"
        server = Server(runtime, ServeOptions(port=port, batch=batch)).start()
        failing.arm()
        out[f"{path}_stream"] = streamed(client.chat.completions.create(stream=True, **ask))
        failing.arm()
        out[f"{path}_whole"] = whole(client.chat.completions.create, **ask)
        failing.armed = False
        out[f"{path}_then_ok"] = client.chat.completions.create(**ask).choices[0].finish_reason
        if batch:
            prompt = dict(model=name, prompt="Hello", max_tokens=40, temperature=0)
            failing.arm()
            out["completions_stream"] = streamed(client.completions.create(stream=True, **prompt), text=True)
            failing.arm()
            out["completions_whole"] = whole(client.completions.create, **prompt)
            failing.armed = False
        out[f"{path}_status"] = next(x for x in server.status_text().splitlines() if x.startswith("requests:"))
        server.stop()
    print(json.dumps(out))


def streamed(stream, text: bool = False) -> dict:
    """The chunks a stream gave before the error event the client raised on, and that error."""
    import openai

    chunks: list[dict] = []
    try:
        for chunk in stream:
            chunks.append(chunk.model_dump())
    except openai.APIError as e:
        raised = {"message": e.message, "code": e.code, "type": e.type}
    else:
        raised = None
    choices = [c["choices"][0] for c in chunks if c["choices"]]
    pieces = [c["text"] if text else c["delta"].get("content") or "" for c in choices]
    return {
        "text_chunks": sum(1 for p in pieces if p),
        "finish_reasons": [c["finish_reason"] for c in choices if c["finish_reason"]],
        "raised": raised,
    }


def whole(create, **fields) -> dict:
    """A whole reply's status, and its error's code and message."""
    import openai

    try:
        create(**fields)
    except openai.APIStatusError as e:
        return {"status": e.status_code, "code": e.code, "message": e.message}
    return {"status": 200}


if __name__ == "__main__":
    main(sys.argv[1])
