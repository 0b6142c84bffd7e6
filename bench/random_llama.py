"""A random Llama checkpoint with a word-level tokenizer for ``gpu_check.py``: drawn in-process, nothing fetched.

The tokenizer maps each of ``vocab_size`` words (``w0`` ... plus the words of the benchmark's prompts) to one
token and decodes every token to visible text, so each generated token is one streamed chunk of content on any
server (shardbook's, vLLM's) and byte-level pieces never hold a chunk back. It has a ChatML template, so chat
completions work on both servers.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

IM_START, IM_END, PAD, UNK = "<|im_start|>", "<|im_end|>", "<|pad|>", "<|unk|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
WORDS = "you are a helpful assistant answer briefly tell me about the city of paris client user system".split()

GPU_SHAPE = dict(
    hidden_size=2048,
    intermediate_size=8192,
    num_hidden_layers=16,
    num_attention_heads=32,
    num_key_value_heads=8,
    vocab_size=32768,
    max_position_embeddings=4096,
)
"""Llama-3.2-1B's shape (1.2B parameters with an untied head) with a 32k vocabulary: big enough that a decode
step is the GPU's work, small enough to write, load and compile within the check's minutes."""
DRY_SHAPE = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=512,
    max_position_embeddings=512,
)
"""A few hundred thousand parameters: the CPU dry run."""


def make_tokenizer(vocab_size: int):
    """A word-level `tokenizers.Tokenizer` of exactly `vocab_size` tokens (4 special ones, the prompts' words, then
    ``w0``, ``w1``...); it decodes tokens joined by spaces."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate([PAD, IM_START, IM_END, UNK, *WORDS])}
    for i in range(vocab_size - len(vocab)):
        vocab[f"w{i}"] = len(vocab)
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in (PAD, IM_START, IM_END, UNK)])
    return tokenizer


def write_random_llama(path: Path, *, shape: dict, dtype: torch.dtype, device: str, seed: int = 0) -> Path:
    """Write a random Llama of `shape` in `dtype` (drawn on `device`), its tokenizer and generation config to
    `path`, as ``save_pretrained`` would lay them out, without importing transformers' model code (seconds of a
    2-core machine's time); returns `path`."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(shape["vocab_size"])
    tokenizer.save(str(path / "tokenizer.json"))
    ids = {token: tokenizer.token_to_id(token) for token in (PAD, IM_END)}
    files = {
        "config.json": llama_config(shape, dtype, eos=ids[IM_END], pad=ids[PAD]),
        "generation_config.json": {"eos_token_id": ids[IM_END], "pad_token_id": ids[PAD]},
        "tokenizer_config.json": {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "eos_token": IM_END,
            "pad_token": PAD,
            "unk_token": UNK,
            "extra_special_tokens": [IM_START, IM_END],
            "chat_template": CHATML_TEMPLATE,
            "model_max_length": shape["max_position_embeddings"],
        },
    }
    for name, content in files.items():
        (path / name).write_text(json.dumps(content, indent=2))
    generator = torch.Generator(device).manual_seed(seed)
    weights = {}
    for name, size in weight_shapes(shape).items():
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(size, dtype=dtype)
        else:
            drawn = torch.randn(size, generator=generator, device=device) * INIT_STD
            weights[name] = drawn.to(dtype).cpu()
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


INIT_STD = 0.02
"""Llama's `initializer_range`: the weights' standard deviation (norms are ones)."""


def llama_config(shape: dict, dtype: torch.dtype, *, eos: int, pad: int) -> dict:
    """`config.json` of a Llama of `shape` (transformers' defaults for everything else)."""
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **shape,
        "head_dim": shape["hidden_size"] // shape["num_attention_heads"],
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False,
        "bos_token_id": None,
        "eos_token_id": eos,
        "pad_token_id": pad,
        "dtype": str(dtype).removeprefix("torch."),
    }


def weight_shapes(shape: dict) -> dict[str, tuple[int, ...]]:
    """Every tensor of a `LlamaForCausalLM` of `shape` with an untied head, by its checkpoint name."""
    h, i, v = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    kv = h * shape["num_key_value_heads"] // shape["num_attention_heads"]
    shapes = {"model.embed_tokens.weight": (v, h)}
    for layer in range(shape["num_hidden_layers"]):
        prefix = f"model.layers.{layer}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (h,),
            f"{prefix}.post_attention_layernorm.weight": (h,),
            f"{prefix}.self_attn.q_proj.weight": (h, h),
            f"{prefix}.self_attn.k_proj.weight": (kv, h),
            f"{prefix}.self_attn.v_proj.weight": (kv, h),
            f"{prefix}.self_attn.o_proj.weight": (h, h),
            f"{prefix}.mlp.gate_proj.weight": (i, h),
            f"{prefix}.mlp.up_proj.weight": (i, h),
            f"{prefix}.mlp.down_proj.weight": (h, i),
        }
    return shapes | {"model.norm.weight": (h,), "lm_head.weight": (v, h)}


def num_parameters(shape: dict) -> int:
    """Parameters of a Llama of `shape` with an untied head (norms included)."""
    return sum(math.prod(size) for size in weight_shapes(shape).values())


def main() -> int:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("path", type=Path)
    p.add_argument("--shape", choices=("gpu", "dry"), default="gpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda", help="where the random weights are drawn (cuda is faster)")
    args = p.parse_args()
    shape = GPU_SHAPE if args.shape == "gpu" else DRY_SHAPE
    write_random_llama(args.path, shape=shape, dtype=getattr(torch, args.dtype), device=args.device)
    print(f"{num_parameters(shape)} parameters")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
