"""Reading a config: YAML files and `--section.key value` overrides, into the schema of `config`.

Precedence is command line > YAML > defaults. Unknown sections and keys are errors that list the
valid ones with the closest match; the training sections and keys of MindSpeed YAML files are
ignored with a warning, so such a file can be reused as it is. A key repeated in one YAML mapping
is an error, not a silent last-one-wins.
"""

from __future__ import annotations

import dataclasses
import difflib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import yaml

from shardbook.rankd.config.schema import (
    SECTIONS,
    ShardbookConfig,
    coerce,
    did_you_mean,
    parse_text,
    require,
    split_optional,
    type_name,
    validate_for_world,
)

logger = logging.getLogger(__name__)


# Sections and keys of MindSpeed training YAMLs that mean nothing to inference: ignored with a warning.
MINDSPEED_SECTIONS = frozenset(
    {"data", "training", "train", "optimization", "optimizer", "lr_scheduler", "checkpoint", "logging", "lora"}
)


MINDSPEED_KEYS = {
    "model": frozenset({"model_id", "train_from_scratch", "init_model_with_meta_device", "tokenizer_name_or_path"}),
    "parallel": frozenset(
        {
            "fsdp_modules",
            "tp_size",
            "ep_modules",
            "ep_fsdp_modules",
            "ep_dispatcher",
            "recompute",
            "recompute_modules",
            "reduce_dtype",
            "cp_size",
            "cp_type",
        }
    ),
}


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
    """Read `path` (defaults only when None), apply `overrides`, validate, and check the layout against `world_size`.

    `path` is a YAML file or a model directory: a directory is the default `model.model_name_or_path`, every other
    setting takes its default (overrides still apply).
    """
    if isinstance(overrides, str):
        raise ValueError("overrides must be a list of tokens, e.g. shlex.split('--inference.max_new_tokens 64')")
    if path is not None and Path(path).is_dir():
        source = f"the defaults (model directory {path})"
        values = empty_values()
        values["model"]["model_name_or_path"] = str(path)
    else:
        source = str(path) if path is not None else "the defaults"
        values = read_sections(read_yaml(Path(path)), source) if path is not None else empty_values()
    apply_overrides(values, parse_overrides(overrides), source)
    config = build_config(values)
    maybe_warn_unused_sampling(config, values)
    if world_size is not None:
        validate_for_world(config, world_size)
    return config


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


def config_from_dict(data: dict, source: str = "a dict") -> ShardbookConfig:
    """Build a config from nested dicts (the inverse of `ShardbookConfig.to_dict`),
    with the same checks as a YAML file."""
    return build_config(read_sections(data, source))


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
