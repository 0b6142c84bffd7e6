"""Tiny local checkpoints for tests: a random Llama with a trained byte-level tokenizer, and a non-causal model.

Nothing here touches a model hub: the tokenizer is a byte-level BPE trained in-process on
the small corpus below, and the weights come from a seeded random initialisation, so the
same arguments always write the same files.
"""

from __future__ import annotations

from pathlib import Path

import torch

IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [PAD, IM_START, IM_END]
TOKENIZER_VOCAB_SIZE = 384

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\nTools:' }}{% for t in tools %}{{ ' ' + t.function.name }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}"
    "{% for m in messages %}{% if m.role == 'tool' %}"
    "{{ '<|im_start|>user\\n<tool_response>' + m.content + '</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + m.role + '\\n' + m.content }}"
    "{% for c in m.tool_calls or [] %}{{ '<tool_call>' + c.function.name }}"
    "{% for k, v in c.function.arguments.items() %}{{ ' ' + k + '=' + v }}{% endfor %}{{ '</tool_call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""ChatML with tools, as Qwen3's (hermes): the tools' names in a system turn, tool results as user turns, earlier
calls with their arguments read as a mapping (as most templates read them)."""

CORPUS = [
    "What is the capital of France? The capital of France is Paris.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps.",
    "Sharded models keep one slice of every weight on each rank.",
    "Hello, world! How are you today? I am fine, thank you.",
    "Numbers: 0 1 2 3 4 5 6 7 8 9 10 42 100 2024 3.14159",
    "def add(a, b):\n    return a + b\n",
    "法国的首都是巴黎。今天天气很好，我们去公园散步吧。",
    "你好，世界！机器学习和深度学习都很有趣。",
    "Emoji time: 🚀 🎉 😀 👍 🐍 ❤️ — rockets, parties and snakes.",
    "Tokenizers split text into pieces; byte-level BPE never fails on unknown text.",
]


def make_tokenizer():
    """A byte-level BPE tokenizer trained on CORPUS, wrapped for transformers, with ChatML."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TOKENIZER_VOCAB_SIZE,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS * 4, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=None,
        eos_token=IM_END,
        pad_token=PAD,
        additional_special_tokens=[IM_START, IM_END],
    )
    tokenizer.chat_template = CHATML_TEMPLATE
    return tokenizer


def make_tiny_llama(path: Path, **kwargs) -> Path:
    """Write a random float32 LlamaForCausalLM (see `make_tiny_lm`)."""
    return make_tiny_lm(path, family="llama", **kwargs)


def make_tiny_lm(
    path: Path,
    *,
    family: str,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    tie_word_embeddings: bool = True,
    seed: int = 0,
    max_shard_size: str | None = None,
    init=None,
    **config_kwargs,
) -> Path:
    """Write a random float32 causal LM of `family` (any transformers model type), its tokenizer and generation config.

    `config_kwargs` go to the family's config (expert counts and sizes for the MoE families).

    `init(model)`, if given, changes the random model before it is saved (e.g. non-zero router biases).
    `max_shard_size` (e.g. "40KB") splits the safetensors into several files with an index.
    """
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    path = Path(path)
    tokenizer = make_tokenizer()
    eos_id = tokenizer.convert_tokens_to_ids(IM_END)
    config = AutoConfig.for_model(
        family,
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=config_kwargs.pop("intermediate_size", 2 * hidden_size),
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=config_kwargs.pop("max_position_embeddings", 256),
        tie_word_embeddings=tie_word_embeddings,
        initializer_range=0.2,
        bos_token_id=None,
        eos_token_id=eos_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
        **config_kwargs,
    )
    with _seeded(seed):
        model = AutoModelForCausalLM.from_config(config).to(torch.float32)
        if init is not None:
            init(model)
    model.generation_config = GenerationConfig(
        eos_token_id=eos_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    save_kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **save_kwargs)
    tokenizer.save_pretrained(path)
    return path


def make_tiny_non_causal(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny random BertModel (an encoder, not a causal LM) and a tokenizer to `path`."""
    from transformers import BertConfig, BertModel

    path = Path(path)
    tokenizer = make_tokenizer()
    config = BertConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    with _seeded(seed):
        BertModel(config).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


class _seeded:
    """Seed torch's CPU generator inside the block and restore its previous state after."""

    def __init__(self, seed: int):
        self.seed = seed

    def __enter__(self):
        self.state = torch.random.get_rng_state()
        torch.manual_seed(self.seed)

    def __exit__(self, *exc):
        torch.random.set_rng_state(self.state)


def make_broken_checkpoints(root: Path) -> dict[str, Path]:
    """Tiny Llama checkpoints damaged in the ways a failed load must survive, by case name.

    The tokenizer and config are the tiny Llama's unless the case breaks them.
    """
    import json
    import shutil

    root = Path(root)
    split = make_tiny_llama(root / "split", max_shard_size="40KB")
    broken = {"empty directory": root / "empty"}
    broken["empty directory"].mkdir()
    broken["missing shard"] = _copy(split, root / "missing-shard")
    sorted(broken["missing shard"].glob("model-*.safetensors"))[1].unlink()
    broken["corrupted header"] = _copy(split, root / "corrupted-header")
    with open(sorted(broken["corrupted header"].glob("model-*.safetensors"))[0], "r+b") as f:
        f.seek(8)
        f.write(b"#not json#")
    broken["bin only"] = _copy(split, root / "bin-only")
    state = {}
    for file in sorted(broken["bin only"].glob("*.safetensors*")):
        if file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state.update(load_file(file))
        file.unlink()
    torch.save(state, broken["bin only"] / "pytorch_model.bin")
    config = json.loads((split / "config.json").read_text())
    broken["unknown model_type"] = _copy(split, root / "unknown-type")
    (broken["unknown model_type"] / "config.json").write_text(json.dumps({**config, "model_type": "no-such-model"}))
    broken["unreadable config.json"] = _copy(split, root / "unreadable-config")
    (broken["unreadable config.json"] / "config.json").write_text(json.dumps(config)[:-20])
    shutil.rmtree(split)
    return broken


def _copy(source: Path, target: Path) -> Path:
    import shutil

    return Path(shutil.copytree(source, target))


def make_long_talker(path: Path) -> Path:
    """The tiny Llama that never ends a reply by itself (end of text suppressed) and has a long context (4096)."""
    import json

    path = never_ending(make_tiny_llama(path))
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 4096}))
    return path


def never_ending(path: Path) -> Path:
    """Suppress the end of text in the checkpoint's generation config, so a reply never ends by itself.

    A random model samples its end of text now and then (at temperature 2.0, within a few tokens in some runs): a
    test that stops a reply, or waits for tokens, must not depend on the model going on."""
    import json

    generation = json.loads((path / "generation_config.json").read_text())
    generation["suppress_tokens"] = [generation["eos_token_id"]]
    (path / "generation_config.json").write_text(json.dumps(generation))
    return path


MOE_FAMILIES = {
    "qwen3_moe": dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
    "qwen2_moe": dict(
        num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48
    ),
    "mixtral": dict(num_local_experts=8, num_experts_per_tok=2),
    "glm4_moe": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        head_dim=16,
    ),
    "deepseek_v3": dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        n_shared_experts=1,
        first_k_dense_replace=1,
        n_group=1,
        topk_group=1,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=16,
    ),
}
"""Tiny mixture-of-experts configurations: 8 experts per layer, 2 per token;
GLM and DeepSeek with a dense first layer."""

_MLA = dict(q_lora_rank=32, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16)
_ROUTED = dict(
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=2,  # grouped routing: the best group of 4 experts first, then the top 2 in it
    topk_group=1,
    routed_scaling_factor=2.5,
)
_INDEXER = dict(index_n_heads=2, index_head_dim=16, index_topk=4)  # top-4 of a longer prompt: the selection matters

MLA_FAMILIES = {
    # GLM-5: 5 heads (3 and 2 per rank); layer 2 reuses layer 1's top-k ("shared" indexer)
    "glm_moe_dsa": dict(
        num_heads=5, num_kv_heads=5, num_layers=3, index_topk_pattern="FFS", **_MLA, **_ROUTED, **_INDEXER
    ),
    "deepseek_v32": dict(num_heads=4, num_kv_heads=4, num_layers=2, **_MLA, **_ROUTED, **_INDEXER),
    "deepseek_v3": dict(num_heads=4, num_kv_heads=4, num_layers=2, **_MLA, **_ROUTED),
}
"""Tiny multi-head latent attention models with grouped routing, a score-correction bias and a shared expert."""


def random_router_bias(model) -> None:
    """A non-zero score-correction bias on every router (transformers initialises it to zeros)."""
    for name, buffer in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(torch.rand_like(buffer) * 0.5)


def make_tiny_mla(path: Path, family: str, **kwargs) -> Path:
    """Write a random float32 MLA mixture-of-experts causal LM of `family` (see `MLA_FAMILIES`)."""
    return make_tiny_lm(path, family=family, init=random_router_bias, **{**MLA_FAMILIES[family], **kwargs})


def make_tiny_moe(path: Path, family: str, **kwargs) -> Path:
    """Write a random float32 MoE causal LM of `family`;
    `save_pretrained` stores its experts one by one, as the Hub does."""
    return make_tiny_lm(path, family=family, num_layers=2, **{**MOE_FAMILIES[family], **kwargs})


DEEPSEEK_V4 = dict(
    num_heads=4,
    num_kv_heads=1,
    num_layers=2,
    head_dim=16,
    q_lora_rank=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=32,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    qk_rope_head_dim=8,
    hc_mult=2,
    sliding_window=8,
)
"""A tiny DeepSeek-V4 (hyper-connections, grouped output LoRA, compressed attention with an indexer)."""


_SMALL_MOE = dict(num_experts_per_tok=2, head_dim=16)

TP_FAMILIES = {
    # 5 query heads on 1 KV head: 3 and 2 per rank, both ranks read the KV head
    "gpt_oss": dict(num_heads=5, num_kv_heads=1, num_local_experts=4, **_SMALL_MOE),
    "qwen3_next": dict(
        num_heads=5,
        num_kv_heads=1,
        num_experts=4,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        layer_types=["linear_attention", "full_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        **_SMALL_MOE,
    ),
    "minimax_m2": dict(num_heads=5, num_kv_heads=1, num_local_experts=4, **_SMALL_MOE),
    # two MLAs of 5 heads per layer, 4 routed experts and 2 zero-compute ones, 2 of 6 per token
    "longcat_flash": dict(
        num_heads=5,
        num_kv_heads=5,
        n_routed_experts=4,
        zero_expert_num=2,
        moe_topk=2,
        expert_ffn_hidden_size=32,
        head_dim=8,  # the rotary width: qk_rope_head_dim
        **_MLA,
    ),
    # attention and hyper-connections whole on every rank; 8 routed experts (4 per rank under ep_size 2)
    "deepseek_v4": DEEPSEEK_V4,
}
"""Tiny GPT-OSS (sinks, expert biases), Qwen3-Next (a Gated DeltaNet layer, then gated attention), MiniMax-M2,
LongCat-Flash and DeepSeek-V4."""


def random_biases(model) -> None:
    """Non-zero expert biases and router biases (transformers initialises them to zeros)."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("_proj_bias", "router.bias")):
                param.copy_(torch.randn_like(param) * 0.2)
    random_router_bias(model)


def make_tiny_tp_family(path: Path, family: str) -> Path:
    """Write a random float32 causal LM of `family` (see `TP_FAMILIES`)."""
    return make_tiny_lm(path, family=family, init=random_biases, **TP_FAMILIES[family])


def cache_bytes_per_token(model) -> int:
    """Bytes a transformers `DynamicCache` holds per token after a one-process forward of 5 tokens of `model`."""
    from transformers import DynamicCache

    from shardbook.rankd.generation.cache_keyword import cache_keyword

    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=torch.ones(1, 5, dtype=torch.long), **{cache_keyword(model): cache}, use_cache=True)
    held = sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))
    return held // 5
