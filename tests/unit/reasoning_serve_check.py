"""Run by test_reasoning_endpoint.py in a process of its own (a world of one rank with a process-wide runtime): a
tiny model taught here to answer with a think block, served on the batch and on ``--no-batch``, asked through the
openai client whole, streamed and cut inside its reasoning. Prints one JSON line of findings."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
REPLY = "<think>Greet back.</think>Hello!"
QUESTION = [{"role": "user", "content": "Hello"}]


def taught_model():
    """A tiny Llama and a tokenizer with think tags, trained until its greedy reply to QUESTION is REPLY."""
    from tests.tiny import make_tokenizer

    tokenizer = make_tokenizer()
    tokenizer.add_tokens(["<think>", "</think>"])  # as Qwen3's: ordinary added tokens, kept in the text
    return teach(tokenizer, [(QUESTION, {}, REPLY)]), tokenizer


def teach(tokenizer, examples, steps: int = 300):
    """A tiny Llama for `tokenizer`, trained until its greedy reply to each example's messages (rendered with its
    template options) is the example's reply, then the end of turn."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from shardbook.rankd.generation.engine import build_prompt_ids
    from tests.tiny import IM_END

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, bos_token_id=None,
        eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )  # fmt: skip
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    batches = []
    for messages, options, text in examples:
        prompt = build_prompt_ids(tokenizer, messages, options)[0].tolist()
        reply = tokenizer(text, add_special_tokens=False)["input_ids"] + [eos]
        batches.append((torch.tensor([prompt + reply]), torch.tensor([[-100] * len(prompt) + reply])))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(steps):
        loss = sum(model(input_ids=ids, labels=labels).loss for ids, labels in batches) / len(batches)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    return model.eval()


def main() -> None:

    from batch_server_check import one_rank_serving  # a sibling script: this one runs as a file too

    from shardbook.kernel.server.server import Server
    from shardbook.kernel.server.state import ServeOptions

    torch.set_num_threads(1)  # before the model is taught
    model, tokenizer = taught_model()
    runtime, port, client = one_rank_serving(model, tokenizer, "/models/tiny-think")
    ask = dict(model="tiny-think", messages=QUESTION, max_tokens=20, temperature=0)
    out: dict = {}
    for batch in (True, False):
        where = "batch" if batch else "no_batch"
        server = Server(runtime, ServeOptions(port=port, batch=batch)).start()
        whole = client.chat.completions.create(**ask)
        message = whole.choices[0].message
        out[f"{where}_whole"] = [message.reasoning_content, message.content]
        out[f"{where}_reasoning_tokens"] = whole.usage.completion_tokens_details.reasoning_tokens
        chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **ask))
        deltas = [c.choices[0].delta for c in chunks if c.choices]
        out[f"{where}_stream"] = [
            "".join(getattr(d, "reasoning_content", None) or "" for d in deltas),
            "".join(d.content or "" for d in deltas),
        ]
        out[f"{where}_stream_reasoning_tokens"] = chunks[-1].usage.completion_tokens_details.reasoning_tokens
        cut = client.chat.completions.create(**{**ask, "max_tokens": 3}).choices[0]
        out[f"{where}_cut"] = [cut.message.reasoning_content, cut.message.content, cut.finish_reason]
        server.stop()
    out["expected_reasoning_tokens"] = len(tokenizer("Greet back.", add_special_tokens=False)["input_ids"])
    print(json.dumps(out))


if __name__ == "__main__":
    main()
