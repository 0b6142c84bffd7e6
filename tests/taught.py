"""Tiny models taught to say what a test needs: a think block, a tool call in a family's format.

A random tiny Llama says nothing on purpose; a few hundred Adam steps on CPU (seconds) make its greedy
reply to each given prompt the given text, so the parsers downstream run on real generated tokens.
``tool_model`` is the one every tool-format test shares: it writes the same call in each family's format.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tests.tiny import IM_END, TOOLS_TEMPLATE, _seeded, make_tokenizer

THINK_TAGS = ["<think>", "</think>"]
"""Qwen3's think tags: ordinary added tokens, kept in the decoded text."""


def tag_tokenizer(tags: list[str], chat_template: str | None = None):
    """The tiny byte-level tokenizer with `tags` added as whole (non-special) tokens, and maybe another template."""
    tokenizer = make_tokenizer()
    tokenizer.add_tokens(tags)
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    return tokenizer


def rendered(tokenizer, examples: list[tuple[list[dict], dict, str]]) -> list[tuple[list[int], str]]:
    """``(messages, template options, reply)`` examples as ``(prompt ids, reply)``, the prompts rendered as every
    rank renders them."""
    from shardbook.rankd.generation.engine import build_prompt_ids

    return [(build_prompt_ids(tokenizer, m, options)[0].tolist(), reply) for m, options, reply in examples]


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


# The tool-calling model: asked "Weather in Paris?", it calls get_weather(city="Paris") in hermes' format, and
# answers the tool's result; asked in a family's name, it writes the call in that family's format.
QUESTION = [{"role": "user", "content": "Weather in Paris?"}]
ANSWER = "It is sunny in Paris."
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TAUGHT_CALL = {
    "role": "assistant",
    "content": "",
    "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
}
RESULT = {"role": "tool", "tool_call_id": "any", "content": "sunny"}
FAMILY_CALLS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
    "glm45": "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>",
    "deepseek_v31": "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
    '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    "kimi_k2": "<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
    '{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>',
    "minimax_m2": '<minimax:tool_call>\n<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n'
    "</invoke>\n</minimax:tool_call>",
    "harmony": "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
    'to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>',
}
"""The same call in each family's format: hermes' the answer to QUESTION, the others' to the question asked in
the family's name (``family_question``); harmony's after a line of reasoning."""
HARMONY_ANSWER = (
    "<|channel|>analysis<|message|>It said sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny."
)
"""The answer to harmony's call's result: reasoning, then the final channel."""
GREETING = "<|channel|>analysis<|message|>A greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hello!"
"""The reply to "Hello", harmony reasoning then an answer (what %%chat and the terminal chat read apart)."""
SPECIAL_TAGS = """<|start|> <|channel|> <|message|> <|end|> <|call|> <|constrain|> <|tool_calls_section_begin|>
<|tool_call_begin|> <|tool_call_argument_begin|> <|tool_call_end|> <|tool_calls_section_end|>""".split()
"""gpt-oss's harmony markers and Kimi-K2's call tokens: special tokens, as in their tokenizers."""
MARKERS = """<tool_call> </tool_call> <arg_key> </arg_key> <arg_value> </arg_value> <｜tool▁calls▁begin｜>
<｜tool▁call▁begin｜> <｜tool▁sep｜> <｜tool▁call▁end｜> <｜tool▁calls▁end｜> <minimax:tool_call>
</minimax:tool_call>""".split()
"""The other families' tags: ordinary added tokens, as Qwen3's, GLM's, ..., kept in the text."""


def get_weather(city: str) -> str:
    """The weather in a city.

    Args:
        city: The city's name.
    """
    return "sunny"


def family_question(name: str) -> list[dict]:
    """The question asked in family `name`'s name (hermes': QUESTION itself)."""
    return QUESTION if name == "hermes" else [{"role": "user", "content": f"Weather in Paris? ({name})"}]


def tool_model(chat_template: str | None = None, extra: tuple = ()):
    """A tiny Llama and a ChatML tokenizer with every family's tool tags, taught each family's call, the answers
    to hermes' and harmony's call results, the harmony greeting, and the `extra` ``(messages, template options,
    reply)`` examples (under `chat_template` when given, else TOOLS_TEMPLATE)."""
    tokenizer = tag_tokenizer(MARKERS, chat_template or TOOLS_TEMPLATE)
    tokenizer.add_tokens(SPECIAL_TAGS, special_tokens=True)
    tools = {"tools": [TOOL]}
    examples = [(family_question(name), tools, call) for name, call in FAMILY_CALLS.items()]
    examples += [
        ([*QUESTION, TAUGHT_CALL, RESULT], tools, ANSWER),
        ([*family_question("harmony"), TAUGHT_CALL, RESULT], tools, HARMONY_ANSWER),
        ([{"role": "user", "content": "Hello"}], {}, GREETING),
        *extra,
    ]
    return teach(tokenizer, rendered(tokenizer, examples), max_steps=600), tokenizer
