"""Tiny models taught to say what a test needs: a think block, a tool call in a family's format.

A random tiny Llama says nothing on purpose; a few hundred Adam steps on CPU (seconds) make its greedy
reply to each given prompt the given text, so the parsers downstream run on real generated tokens.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import IM_END, _seeded, make_tokenizer

THINK_TAGS = ["<think>", "</think>"]
"""Qwen3's think tags: ordinary added tokens, kept in the decoded text."""


def tag_tokenizer(tags: list[str], chat_template: str | None = None):
    """The tiny byte-level tokenizer with `tags` added as whole (non-special) tokens, and maybe another template."""
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(tags)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def teach(tokenizer, examples: list[tuple[list[int], str]], *, max_steps: int = 400, hidden_size: int = 64):
    """A tiny float32 Llama trained until its greedy reply to each ``(prompt_ids, reply)`` is ``reply`` then the
    end-of-turn token (the loss under 1e-3, or `max_steps`); eval mode."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    eos = tokenizer.convert_tokens_to_ids(IM_END)
    longest = max(len(p) + len(tokenizer(r, add_special_tokens=False)["input_ids"]) + 1 for p, r in examples)
    config = AutoConfig.for_model(
        "llama", vocab_size=len(tokenizer), hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=max(256, 2 * longest), bos_token_id=None, eos_token_id=eos,
        pad_token_id=tokenizer.pad_token_id, dtype="float32",
    )  # fmt: skip
    with _seeded(0):
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.generation_config = GenerationConfig(eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    ids, labels, mask = _batch(tokenizer, examples, eos)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    for _ in range(max_steps):
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if loss.item() < 1e-3:
            break
    return model.eval()


def _batch(tokenizer, examples: list[tuple[list[int], str]], eos: int):
    """Right-padded ids, labels on the replies only, and the attention mask."""
    rows = []
    for prompt, reply in examples:
        answer = tokenizer(reply, add_special_tokens=False)["input_ids"] + [eos]
        rows.append((prompt + answer, [-100] * len(prompt) + answer))
    width = max(len(r[0]) for r in rows)
    pad = tokenizer.pad_token_id
    ids = torch.tensor([r[0] + [pad] * (width - len(r[0])) for r in rows])
    labels = torch.tensor([r[1] + [-100] * (width - len(r[1])) for r in rows])
    mask = torch.tensor([[1] * len(r[0]) + [0] * (width - len(r[0])) for r in rows])
    return ids, labels, mask


def save_taught(path: Path, model, tokenizer) -> Path:
    """Write the taught model and its tokenizer as a checkpoint ``%load_sharded`` reads."""
    path = Path(path)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
