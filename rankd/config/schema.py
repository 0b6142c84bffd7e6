"""The config's schema: dataclass sections (`model`, `parallel`, `inference`) whose fields check their own values.

Every field carries a docstring that `reference.field_docs` reads back (joined into one line), and
`reference.config_reference_markdown` renders them as the table in docs/configuration.md. Values are coerced and
checked in `__post_init__`, so a section built directly is checked like one read from YAML. Reading YAML files and
command-line overrides into these sections is `parsing`'s job.
"""

import dataclasses
import difflib
import logging
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field

from shardbook.rankd.control.world import DEVICE_CHOICES

logger = logging.getLogger(__name__)

DTYPES = ("auto", "fastest", "float32", "bfloat16", "float16")
DECODE_LAYOUTS = ("auto", "tp", "gather", "reshard")
FP8_WEIGHTS = ("dequantize", "keep", "keep-reference")
INFER_BACKENDS = ("huggingface",)
REASONING_PARSERS = ("auto", "think", "harmony", "none")
"""How a reply's reasoning may be read (``inference.reasoning_parser``); the kernel's reasoning parsers are named so."""
TOOL_CALL_PARSERS = tuple("auto none hermes glm45 deepseek_v31 deepseek_v32 kimi_k2 minimax_m2 harmony".split())
"""How a reply's tool calls may be read (``inference.tool_call_parser``): the kernel's tool formats, ``auto`` and
``none``. Kept here because the config (rankd) may not import the kernel's parsers; a unit test keeps them equal."""
BOOL_WORDS = {
    "true": True,
    "yes": True,
    "on": True,
    "1": True,
    "false": False,
    "no": False,
    "off": False,
    "0": False,
}
NONE_WORDS = ("none", "null")
# Spellings difflib would get wrong ("gpu" is closest to "cpu") or miss.
SUGGESTIONS = {
    "gpu": "cuda",
    "bf16": "bfloat16",
    "fp16": "float16",
    "half": "float16",
    "fp32": "float32",
    "hf": "huggingface",
}


@dataclass
class ModelConfig:
    """Which checkpoint to load, and in which dtype."""

    model_name_or_path: str = "smollm2-135m-instruct"
    """A local Hugging Face checkpoint directory, or a registered demo name such as `smollm2-135m-instruct`."""
    dtype: str = "auto"
    """Weight dtype: auto (the checkpoint's own), fastest (bfloat16 on a GPU, an NPU or a CPU with AMX or
    AVX512-BF16, else float32), float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Run modelling code shipped inside the checkpoint directory; only for checkpoints you trust."""
    fp8_weights: str = "dequantize"
    """FP8 block weights: dequantize, keep (FP8 under tp where torch's FP8 matmul runs, else dequantized with a
    warning) or keep-reference (FP8 on any device, computed by the slow reference path; for checking)."""
    chat_template: str | None = None
    """A Jinja chat template file used instead of the tokenizer's own on every rank (e.g. one that renders tools),
    read at load on each node; null keeps the tokenizer's."""

    def __post_init__(self) -> None:
        coerce_fields(self, "model")
        require(
            self.chat_template is None or bool(self.chat_template.strip()),
            "model.chat_template is empty: give the path of a Jinja chat template file, or null to keep the "
            "tokenizer's own",
        )
        require(
            bool(self.model_name_or_path),
            "model.model_name_or_path is empty: set it to a checkpoint directory "
            "or a demo name such as smollm2-135m-instruct",
        )
        check_choice("model.dtype", self.dtype, DTYPES)
        check_choice("model.fp8_weights", self.fp8_weights, FP8_WEIGHTS)


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks of the job."""

    fsdp_size: int = -1
    """Ranks that share one FSDP-sharded copy of the model; -1 means every rank of the job."""
    ep_size: int = 1
    """Expert-parallel size for mixture-of-experts models: experts split over this many consecutive ranks
    (decode tp)."""
    ep_fsdp_size: int = 1
    """Each expert's rows split again over this many ranks; 1 and ep_size 1: experts split like a dense MLP under tp."""
    decode: str = "auto"
    """Forward layout: tp (weights stay sharded, activations move), gather, reshard, or auto (gather if it fits)."""
    reshard_after_forward: bool | None = None
    """MindSpeed's switch, kept for its YAMLs: true means decode reshard, false decode gather; null says nothing."""
    device: str = "auto"
    """Device type: auto (npu if torch_npu has devices, else cuda, else cpu), cpu, cuda or npu."""

    def __post_init__(self) -> None:
        coerce_fields(self, "parallel")
        require(
            self.fsdp_size == -1 or self.fsdp_size >= 1,
            f"parallel.fsdp_size must be -1 (every rank) or a positive number of ranks; got {self.fsdp_size}",
        )
        require(
            self.ep_size >= 1 and self.ep_fsdp_size >= 1,
            f"parallel.ep_size and parallel.ep_fsdp_size must be >= 1; got {self.ep_size} and {self.ep_fsdp_size}",
        )
        check_choice("parallel.device", self.device, DEVICE_CHOICES)
        check_choice("parallel.decode", self.decode, DECODE_LAYOUTS)
        self.decode = decode_from_reshard_flag(self.decode, self.reshard_after_forward)
        require(
            self.ep_size * self.ep_fsdp_size == 1 or self.decode in ("auto", "tp"),
            f"parallel.ep_size={self.ep_size} x ep_fsdp_size={self.ep_fsdp_size} is expert parallelism, which runs in "
            f"the tp layout, but parallel.decode is {self.decode}: "
            "set parallel.decode tp (or auto), or both sizes to 1",
        )

    def fsdp_size_for(self, world_size: int) -> int:
        """The FSDP axis size in a job of `world_size` ranks (-1 resolves to all of them)."""
        return world_size if self.fsdp_size == -1 else self.fsdp_size


def decode_from_reshard_flag(decode: str, reshard_after_forward: bool | None) -> str:
    """`decode` with MindSpeed's `reshard_after_forward` folded in (true: reshard, false: gather),
    noting the mapping."""
    if reshard_after_forward is None:
        return decode
    implied = "reshard" if reshard_after_forward else "gather"
    require(
        decode in ("auto", implied),
        f"parallel.reshard_after_forward={yaml_text(reshard_after_forward)} means parallel.decode {implied}, "
        f"but parallel.decode is {decode}: remove one of them (parallel.decode is the one to keep)",
    )
    if decode == "auto":
        logger.warning(
            "parallel.reshard_after_forward=%s: using parallel.decode %s (the layout it names)",
            yaml_text(reshard_after_forward),
            implied,
        )
    return implied


@dataclass
class InferenceConfig:
    """How replies are generated; the defaults are those of Hugging Face `generate`, except max_new_tokens."""

    infer_backend: str = "huggingface"
    """Generation engine; only huggingface (transformers `generate` on every rank) exists."""
    max_new_tokens: int = 512
    """Most tokens generated for one reply."""
    do_sample: bool = False
    """Sample the next token; false decodes greedily and ignores temperature, top_p and top_k."""
    temperature: float = 1.0
    """Softmax temperature when sampling; must be > 0."""
    top_p: float = 1.0
    """Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p; in (0, 1]."""
    top_k: int = 50
    """Keep only the top_k most likely tokens when sampling; 0 keeps all."""
    repetition_penalty: float = 1.0
    """Penalty on tokens already in the context; 1.0 means none."""
    seed: int | None = None
    """Seed every rank samples with; null lets rank 0 pick a fresh one for each turn."""
    system_prompt: str | None = None
    """System message put before the conversation; null sends none."""
    reasoning_parser: str = "auto"
    """How a reply's reasoning is read apart from its answer (`%%chat`, the terminal chat, `ChatModel`, the
    endpoint's `reasoning_content`): auto (from the model's config and vocabulary), think (`<think>` tags), harmony
    (gpt-oss's channels) or none (all of it answer). A server's `--reasoning-parser`, when given, overrides it."""
    tool_call_parser: str = "auto"
    """The format a reply's tool calls are read in (`%%chat --tools`, `ChatModel.chat(tools=...)`, the endpoint's
    `tool_calls`): auto (from the model's config and vocabulary), none (no calls read: tools are refused), hermes,
    glm45, deepseek_v31 (also DeepSeek-V3.2-Exp's), deepseek_v32, kimi_k2, minimax_m2 or harmony (docs/serving.md's
    parser tables). A server's `--tool-call-parser`, when given, overrides it."""
    max_batch_sequences: int | None = None
    """Most sequences decoded together in one batch (continuous batching); more wait for a place. null: as many as
    the KV budget holds at 512 prompt tokens plus max_new_tokens, at most 32 on a CPU (64 for bfloat16 on a CPU
    with AMX or AVX512-BF16) and 256 on a GPU or NPU."""
    max_step_tokens: int = 2048
    """Most tokens one batch step forwards (decoding rows plus the joining prompts padded to the longest); a longer
    prompt is prefilled in chunks, the rest of each step's room a step, while the running rows decode."""
    max_cache_tokens: int | None = None
    """Most tokens the batch's KV cache holds (sequences times the longest, each counted with its prompt and all
    its max_tokens); a request that would exceed it waits, one that never fits is refused. null: what fits in
    half of the smallest free memory of any rank after the load (the load's summary shows it)."""
    prefix_cache_share: float = 0.25
    """Share of the batch's KV budget (inference.max_cache_tokens or the load's measure) that keeps the keys and
    values of finished sequences' whole 16-token blocks, so a prompt that starts with them (a conversation's next
    turn, a shared system prompt) prefills only the rest; least recently used blocks go first. Kept on top of the
    batch's own cache, for full-attention models only; 0 turns prefix reuse off."""
    join_window_ms: float = 10.0
    """When the batch is empty, rank 0 waits until no request has arrived for this long (at most ten times it)
    before the first prefill, so requests sent together share one prefill forward; 0 does not wait."""

    def __post_init__(self) -> None:
        coerce_fields(self, "inference")
        check_choice("inference.infer_backend", self.infer_backend, INFER_BACKENDS)
        check_choice("inference.reasoning_parser", self.reasoning_parser, REASONING_PARSERS)
        check_choice("inference.tool_call_parser", self.tool_call_parser, TOOL_CALL_PARSERS)
        require(self.max_new_tokens >= 1, f"inference.max_new_tokens must be >= 1; got {self.max_new_tokens}")
        require(
            self.temperature > 0,
            f"inference.temperature must be > 0; got {self.temperature} (for greedy decoding set do_sample: false)",
        )
        require(0 < self.top_p <= 1, f"inference.top_p must be in (0, 1]; got {self.top_p}")
        require(self.top_k >= 0, f"inference.top_k must be >= 0 (0 keeps all tokens); got {self.top_k}")
        require(
            self.repetition_penalty > 0,
            f"inference.repetition_penalty must be > 0 (1.0 means none); got {self.repetition_penalty}",
        )
        require(self.seed is None or self.seed >= 0, f"inference.seed must be >= 0 or null; got {self.seed}")
        require(
            self.max_batch_sequences is None or self.max_batch_sequences >= 1,
            f"inference.max_batch_sequences must be >= 1 or null; got {self.max_batch_sequences}",
        )
        require(self.max_step_tokens >= 1, f"inference.max_step_tokens must be >= 1; got {self.max_step_tokens}")
        require(
            self.max_cache_tokens is None or self.max_cache_tokens >= 1,
            f"inference.max_cache_tokens must be >= 1 or null; got {self.max_cache_tokens}",
        )
        require(
            0 <= self.prefix_cache_share <= 1,
            f"inference.prefix_cache_share must be in [0, 1] (0 turns prefix reuse off); got {self.prefix_cache_share}",
        )
        require(self.join_window_ms >= 0, f"inference.join_window_ms must be >= 0; got {self.join_window_ms}")


@dataclass
class ShardbookConfig:
    """Everything `%load_sharded` and the chat need: one section per concern."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The checkpoint and its dtype."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The layout over ranks."""
    inference: InferenceConfig = field(default_factory=InferenceConfig)
    """The generation settings."""

    def to_dict(self) -> dict[str, dict[str, object]]:
        """The config as plain nested dicts, ready for YAML, JSON or the control plane."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """A three-line summary for logs and banners."""
        model, parallel, inference = self.model, self.parallel, self.inference
        fsdp = "every rank" if parallel.fsdp_size == -1 else parallel.fsdp_size
        layout = "loader decides" if parallel.decode == "auto" else parallel.decode
        decoding = "greedy"
        if inference.do_sample:
            decoding = (
                f"sampling (temperature={inference.temperature}, top_p={inference.top_p}, top_k={inference.top_k})"
            )
        return (
            f"model: {model.model_name_or_path} (dtype {model.dtype})\n"
            f"parallel: fsdp_size={fsdp}, decode={layout}, device={parallel.device}\n"
            f"inference: {inference.infer_backend}, {decoding}, max_new_tokens={inference.max_new_tokens}"
        )


SECTIONS: dict[str, type] = {"model": ModelConfig, "parallel": ParallelConfig, "inference": InferenceConfig}


def validate_for_world(config: ShardbookConfig, world_size: int) -> None:
    """Check that the parallel layout fits a job of `world_size` ranks."""
    require(world_size >= 1, f"world_size must be >= 1; got {world_size}")
    fsdp_size = config.parallel.fsdp_size
    if fsdp_size != -1 and world_size % fsdp_size:
        divisors = ", ".join(str(d) for d in range(1, world_size + 1) if world_size % d == 0)
        raise ValueError(
            f"parallel.fsdp_size={fsdp_size} does not divide the world size {world_size}; "
            f"use -1 (every rank) or one of {divisors}"
        )
    experts = config.parallel.ep_size * config.parallel.ep_fsdp_size
    if world_size % experts:
        raise ValueError(
            f"the world size {world_size} is not divisible by parallel.ep_size x parallel.ep_fsdp_size = "
            f"{config.parallel.ep_size} x {config.parallel.ep_fsdp_size} = {experts}: pick sizes whose product divides "
            f"{world_size}"
        )


def did_you_mean(matches: list[str]) -> str:
    """`; did you mean 'x'?` for the first of `matches`, or a full stop when there is none."""
    return f"; did you mean '{matches[0]}'?" if matches else "."


def check_choice(name: str, value: str, choices: Sequence[str]) -> None:
    """Raise a ValueError naming the allowed values unless `value` is one of `choices`."""
    if value not in choices:
        alias = SUGGESTIONS.get(value.lower())
        hint = did_you_mean([alias] if alias else difflib.get_close_matches(value, list(choices), n=1))
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless `condition` holds."""
    if not condition:
        raise ValueError(message)


def split_optional(field_type: object) -> tuple[type, bool]:
    """(`int`, True) for `int | None`; (`int`, False) for `int`."""
    args = typing.get_args(field_type)
    if type(None) not in args:
        return field_type, False
    (base,) = [arg for arg in args if arg is not type(None)]
    return base, True


def type_name(field_type: object) -> str:
    """A field type as users read it: `int`, or `int or null` for an optional one."""
    base, optional = split_optional(field_type)
    return f"{base.__name__} or null" if optional else base.__name__


def parse_text(name: str, text: str, field_type: object, where: str) -> object:
    """Turn command-line text into a `field_type` value (bool: true/false, yes/no, on/off, 1/0; optional: none/null)."""
    base, optional = split_optional(field_type)
    if optional and text.lower() in NONE_WORDS:
        return None
    if base is str:
        return text
    if base is bool and text.lower() in BOOL_WORDS:
        return BOOL_WORDS[text.lower()]
    if base in (int, float):
        try:
            return base(text)
        except ValueError:
            pass
    hint = " (true/false, yes/no, on/off or 1/0)" if base is bool else ""
    raise ValueError(f"invalid value {text!r} for {name}{where}: expected {type_name(field_type)}{hint}")


def coerce(name: str, value: object, field_type: object, where: str = "") -> object:
    """Check `value` against `field_type`: an int becomes a float where a float is expected; text is parsed."""
    base, optional = split_optional(field_type)
    if value is None and optional:
        return None
    if isinstance(value, str) and base is not str:
        return parse_text(name, value, field_type, where)
    if base is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, base) and not (base is int and isinstance(value, bool)):
        return value
    hint = " (quote it in YAML to keep it as text)" if base is str else ""
    raise ValueError(
        f"invalid value {value!r} for {name}{where}: expected {type_name(field_type)}, got {type(value).__name__}{hint}"
    )


def coerce_fields(section_config: object, section: str) -> None:
    """Coerce every field of a section dataclass in place, so direct construction is checked like a YAML file."""
    for f in dataclasses.fields(section_config):
        setattr(section_config, f.name, coerce(f"{section}.{f.name}", getattr(section_config, f.name), f.type))


def yaml_text(value: object) -> str:
    """A default value as it is written in YAML."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
