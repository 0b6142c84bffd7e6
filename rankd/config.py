"""Inference configuration: dataclass sections loaded from YAML plus `--section.key value` overrides, validated.

Precedence is command line > YAML > defaults. Unknown sections and keys are errors that list the
valid ones; the training sections of MindSpeed YAML files are ignored with a warning, so such a
file can be reused as it is. Every field carries a one-line docstring that `config_reference.field_docs` reads back,
and `config_reference_markdown` renders them as the README's table.
"""

import dataclasses
import difflib
import logging
import typing
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from shardbook.rankd.world import DEVICE_CHOICES

logger = logging.getLogger(__name__)

DTYPES = ("auto", "float32", "bfloat16", "float16")
DECODE_LAYOUTS = ("auto", "tp", "gather", "reshard")
INFER_BACKENDS = ("huggingface",)
BOOL_WORDS = {
    "true": True, "yes": True, "on": True, "1": True,
    "false": False, "no": False, "off": False, "0": False,
}
NONE_WORDS = ("none", "null")
# Spellings difflib would get wrong ("gpu" is closest to "cpu") or miss.
SUGGESTIONS = {
    "gpu": "cuda", "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "hf": "huggingface"
}
# Sections and keys of MindSpeed training YAMLs that mean nothing to inference: ignored with a warning.
MINDSPEED_SECTIONS = frozenset(
    {"data", "training", "train", "optimization", "optimizer", "lr_scheduler", "checkpoint", "logging", "lora"}
)
MINDSPEED_KEYS = {
    "model": frozenset({"model_id", "train_from_scratch", "init_model_with_meta_device", "tokenizer_name_or_path"}),
    "parallel": frozenset({"fsdp_modules", "tp_size", "ep_modules", "ep_fsdp_modules", "ep_dispatcher", "recompute",
                           "recompute_modules", "reduce_dtype", "cp_size", "cp_type"}),
}


@dataclass
class ModelConfig:
    """Which checkpoint to load, and in which dtype."""

    model_name_or_path: str = "smollm2-135m-instruct"
    """A local Hugging Face checkpoint directory, or a registered demo name such as `smollm2-135m-instruct`."""
    dtype: str = "auto"
    """Weight dtype: auto (the checkpoint's own), float32, bfloat16 or float16."""
    trust_remote_code: bool = False
    """Run modelling code shipped inside the checkpoint directory; only for checkpoints you trust."""

    def __post_init__(self) -> None:
        coerce_fields(self, "model")
        require(
            bool(self.model_name_or_path),
            "model.model_name_or_path is empty: set it to a checkpoint directory "
            "or a demo name such as smollm2-135m-instruct",
        )
        check_choice("model.dtype", self.dtype, DTYPES)


@dataclass
class ParallelConfig:
    """How the model is laid out over the ranks of the job."""

    fsdp_size: int = -1
    """Ranks that share one FSDP-sharded copy of the model; -1 means every rank of the job."""
    ep_size: int = 1
    """Expert-parallel size for mixture-of-experts models; only 1 is supported yet."""
    ep_fsdp_size: int = 1
    """FSDP size inside each expert-parallel group; only 1 is supported yet."""
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
            self.ep_size == 1 and self.ep_fsdp_size == 1,
            "expert parallelism is not supported yet: set parallel.ep_size and parallel.ep_fsdp_size to 1 "
            f"(got {self.ep_size} and {self.ep_fsdp_size}); experts are then sharded by FSDP like every other layer",
        )
        check_choice("parallel.device", self.device, DEVICE_CHOICES)
        check_choice("parallel.decode", self.decode, DECODE_LAYOUTS)
        self.decode = decode_from_reshard_flag(self.decode, self.reshard_after_forward)

    def fsdp_size_for(self, world_size: int) -> int:
        """The FSDP axis size in a job of `world_size` ranks (-1 resolves to all of them)."""
        return world_size if self.fsdp_size == -1 else self.fsdp_size


def decode_from_reshard_flag(decode: str, reshard_after_forward: bool | None) -> str:
    """`decode` with MindSpeed's `reshard_after_forward` folded in (true: reshard, false: gather), noting the mapping."""
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
            yaml_text(reshard_after_forward), implied,
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

    def __post_init__(self) -> None:
        coerce_fields(self, "inference")
        check_choice("inference.infer_backend", self.infer_backend, INFER_BACKENDS)
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

    @classmethod
    def from_dict(cls, data: dict, source: str = "a dict") -> "ShardbookConfig":
        """Build a config from nested dicts (the inverse of `to_dict`), with the same checks as a YAML file."""
        return build_config(read_sections(data, source))

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
SAMPLING_KEYS = ("temperature", "top_p", "top_k")


@dataclass(frozen=True)
class Override:
    """One `--section.key value` from the command line."""

    section: str
    """Config section, e.g. `inference`."""
    key: str
    """Field inside the section, e.g. `max_new_tokens`."""
    text: str | None
    """The value as typed, or None for a bare flag."""


def load_config(
    path: str | Path | None = None, overrides: Sequence[str] = (), world_size: int | None = None
) -> ShardbookConfig:
    """Read `path` (defaults only when None), apply `overrides`, validate, and check the layout against `world_size`."""
    if isinstance(overrides, str):
        raise ValueError("overrides must be a list of tokens, e.g. shlex.split('--inference.max_new_tokens 64')")
    source = str(path) if path is not None else "the defaults"
    values = read_sections(read_yaml(Path(path)), source) if path is not None else empty_values()
    apply_overrides(values, parse_overrides(overrides), source)
    config = build_config(values)
    maybe_warn_unused_sampling(config, values)
    if world_size is not None:
        validate_for_world(config, world_size)
    return config


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


class UniqueKeyLoader(yaml.SafeLoader):
    """A SafeLoader that rejects a key repeated in one mapping instead of silently keeping the last value."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                if key_node.value in seen:
                    problem, mark = f"found duplicate key {key_node.value!r}", key_node.start_mark
                    raise yaml.constructor.ConstructorError("in a mapping", node.start_mark, problem, mark)
                seen.add(key_node.value)
        return super().construct_mapping(node, deep)


def read_yaml(path: Path) -> dict:
    """The top-level mapping of the YAML file at `path`; every failure is a ValueError naming the file."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError as e:
        raise ValueError(f"config file not found: {path}; check the path, or pass none to use the defaults") from e
    except OSError as e:
        raise ValueError(f"cannot read config file {path}: {e.strerror}") from e
    try:
        data = yaml.load(text, Loader=UniqueKeyLoader)
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"YAML error in {path}{where}: {e.problem or e.context}") from e
    except yaml.YAMLError as e:
        raise ValueError(f"YAML error in {path}: {e}") from e
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(
            f"{path} must hold a mapping of sections (model:, parallel:, inference:) at the top level; "
            f"got a {type(data).__name__}"
        )
    return data


def empty_values() -> dict[str, dict[str, object]]:
    """One empty dict of given values per section."""
    return {name: {} for name in SECTIONS}


def read_sections(data: dict, source: str) -> dict[str, dict[str, object]]:
    """Type the values of each section in `data`; MindSpeed training sections and keys are dropped, with a warning."""
    values = empty_values()
    ignored = [str(name) for name in data if name in MINDSPEED_SECTIONS]
    for name, body in data.items():
        if name in MINDSPEED_SECTIONS:
            continue
        if name not in SECTIONS:
            raise unknown_section_error(str(name), f" in {source}")
        if body is None:
            continue
        if not isinstance(body, dict):
            raise ValueError(
                f"section '{name}' in {source} must be a mapping of key: value; got a {type(body).__name__}"
            )
        ignored += read_section(values[name], name, body, source)
    if ignored:
        logger.warning("ignoring MindSpeed training settings in %s: %s", source, ", ".join(ignored))
    return values


def read_section(values: dict[str, object], section: str, body: dict, source: str) -> list[str]:
    """Type each key of `body` into `values`; return the dotted names of the MindSpeed keys it skipped."""
    skipped = []
    for key, value in body.items():
        if key in MINDSPEED_KEYS.get(section, ()):
            skipped.append(f"{section}.{key}")
            continue
        field_type = lookup_field(section, str(key), f" in {source}")
        values[key] = coerce(f"{section}.{key}", value, field_type, f" in {source}")
    return skipped


def parse_overrides(tokens: Sequence[str]) -> list[Override]:
    """Split argv-style tokens into overrides: `--s.k value`, `--s.k=value`, or a bare `--s.k` (a true bool)."""
    overrides = []
    index = 0
    while index < len(tokens):
        token = tokens[index]
        if not token.startswith("--"):
            raise ValueError(
                f"unexpected argument {token!r}: write overrides as --section.key value or --section.key=value, "
                "e.g. --inference.max_new_tokens 64 (use the = form for a value that starts with --)"
            )
        name, has_equals, text = token[2:].partition("=")
        if not has_equals:
            has_value = index + 1 < len(tokens) and not tokens[index + 1].startswith("--")
            text = tokens[index + 1] if has_value else None
            if has_value:
                index += 1
        section, _, key = name.partition(".")
        if not section or not key or "." in key:
            raise ValueError(f"override {token!r} must name section.key, e.g. --inference.max_new_tokens 64")
        overrides.append(Override(section, key, text))
        index += 1
    return overrides


def apply_overrides(values: dict[str, dict[str, object]], overrides: list[Override], source: str) -> None:
    """Write each override into `values`, logging the YAML values it replaces and warning about repeated flags."""
    given = {}
    for override in overrides:
        name = f"{override.section}.{override.key}"
        value = override_value(override, lookup_field(override.section, override.key, " on the command line"))
        if name in given:
            logger.warning("--%s given twice on the command line: using %r, ignoring %r", name, value, given[name])
        elif override.key in values[override.section]:
            logger.info("--%s=%r replaces %r from %s", name, value, values[override.section][override.key], source)
        given[name] = value
        values[override.section][override.key] = value


def override_value(override: Override, field_type: object) -> object:
    """The typed value of one override; a bare flag is true for a bool field and an error otherwise."""
    name = f"{override.section}.{override.key}"
    if override.text is not None:
        return parse_text(name, override.text, field_type, " on the command line")
    require(
        split_optional(field_type)[0] is bool,
        f"--{name} needs a value ({type_name(field_type)}): --{name} VALUE or --{name}=VALUE",
    )
    return True


def build_config(values: dict[str, dict[str, object]]) -> ShardbookConfig:
    """Construct every section from its given values, defaults filling the rest."""
    return ShardbookConfig(**{name: cls(**values[name]) for name, cls in SECTIONS.items()})


def maybe_warn_unused_sampling(config: ShardbookConfig, values: dict[str, dict[str, object]]) -> None:
    """Warn when sampling settings were given but greedy decoding will ignore them."""
    unused = [f"inference.{key}" for key in SAMPLING_KEYS if key in values["inference"]]
    if unused and not config.inference.do_sample:
        logger.warning(
            "%s ignored: inference.do_sample is false (greedy decoding); pass --inference.do_sample to sample",
            ", ".join(unused),
        )


def lookup_field(section: str, key: str, where: str) -> object:
    """The type of `section.key`, or a ValueError listing the valid sections or keys and the closest match."""
    if section not in SECTIONS:
        raise unknown_section_error(section, where)
    types = {f.name: f.type for f in dataclasses.fields(SECTIONS[section])}
    if key not in types:
        valid = ", ".join(types)
        raise ValueError(
            f"unknown key '{section}.{key}'{where}{did_you_mean(closest_key(section, key))} "
            f"Valid keys of [{section}]: {valid}"
        )
    return types[key]


def unknown_section_error(section: str, where: str) -> ValueError:
    """The error for a top-level section that is neither ours nor MindSpeed's."""
    return ValueError(
        f"unknown section '{section}'{where}{did_you_mean(difflib.get_close_matches(section, list(SECTIONS), n=1))} "
        f"Valid sections: {', '.join(SECTIONS)} (MindSpeed training sections such as training and data are ignored)"
    )


def closest_key(section: str, key: str) -> list[str]:
    """The dotted name closest to `key`: first within `section`, then in the other sections."""
    same = difflib.get_close_matches(key, [f.name for f in dataclasses.fields(SECTIONS[section])], n=1)
    if same:
        return [f"{section}.{same[0]}"]
    others = {
        f.name: f"{name}.{f.name}" for name, cls in SECTIONS.items() if name != section for f in dataclasses.fields(cls)
    }
    return [others[match] for match in difflib.get_close_matches(key, list(others), n=1)]


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
