"""Where a load's settings come from: a YAML file, a model directory, a packaged config by its short name, or none.

    %load_sharded demo                                    # the packaged SmolLM2 config
    shardbook chat --nproc 2 ~/models/Qwen2.5-7B-Instruct  # a model directory: every setting at its default
    shardbook chat --nproc 2 my.yaml --parallel.decode tp # a YAML file, overridden
    %load_sharded --model.model_name_or_path smollm2-135m-instruct   # no config at all

The example configs travel with the package (``shardbook.configs``, the repository's ``configs/``);
``shardbook configs`` lists them with their paths so that one can be copied and edited. A path that
exists wins over a short name of the same spelling.
"""

from __future__ import annotations

import importlib.resources
from dataclasses import dataclass
from pathlib import Path

from shardbook.kernel.api.fetch import DEMO_MODELS, resolve_model_path

PACKAGED_CONFIGS: dict[str, str] = {
    "demo": "smollm2-135m.yaml",
    "smollm2-135m": "smollm2-135m.yaml",
    "qwen-8rank": "qwen-8rank.yaml",
    "glm-744b-npu": "glm-744b-npu.yaml",
    "glm-744b-fp8-npu": "glm-744b-fp8-npu.yaml",
}
"""Short name -> file in ``shardbook.configs``: the file stem, and ``demo`` for the SmolLM2 demo config."""

DESCRIPTIONS: dict[str, str] = {
    "smollm2-135m.yaml": "SmolLM2-135M-Instruct, the demo model (shardbook fetch smollm2-135m-instruct), any ranks",
    "qwen-8rank.yaml": "Qwen2.5-7B-Instruct on one node of 8 accelerators (set model_name_or_path)",
    "glm-744b-npu.yaml": "a 744B GLM mixture of experts on 2 nodes x 16 Ascend NPUs (set model_name_or_path)",
    "glm-744b-fp8-npu.yaml": "GLM-5-FP8's official FP8 blocks on 2 nodes x 16 Ascend NPUs, dequantized to bf16 as each "
    "rank loads (set model_name_or_path)",
}
"""What each packaged file is for, as `shardbook configs` shows it."""


@dataclass(frozen=True)
class ConfigSource:
    """What `load_config` reads (a YAML file, a model directory, or None) and how the load summary names it."""

    path: Path | None
    """A YAML file, or a model directory (every setting at its default), or None (defaults only)."""
    description: str
    """E.g. 'config file /x/my.yaml', 'packaged config demo (/site-packages/shardbook/configs/smollm2-135m.yaml)',
    'no config file (model directory /x/model, defaults for every setting)'."""


def packaged_config_dir() -> Path:
    """The installed ``configs/`` folder (inside the wheel's ``shardbook/configs``, or the checkout's ``configs/``)."""
    return Path(str(importlib.resources.files("shardbook.configs")))


def packaged_configs() -> dict[str, Path]:
    """Short name -> path of every packaged config, in the order of `PACKAGED_CONFIGS`."""
    folder = packaged_config_dir()
    return {name: folder / file for name, file in PACKAGED_CONFIGS.items()}


def resolve_config(target: str | None) -> ConfigSource:
    """Turn the CONFIG argument into a `ConfigSource`; ValueError (listing the short names) when it names nothing."""
    if target is None:
        return ConfigSource(None, "no config file (defaults and command-line overrides)")
    path = Path(target).expanduser()
    if path.is_dir():
        return ConfigSource(path, f"no config file (model directory {path}, defaults for every setting)")
    if path.is_file():
        return ConfigSource(path, f"config file {path}")
    if target in PACKAGED_CONFIGS:
        packaged = packaged_configs()[target]
        return ConfigSource(packaged, f"packaged config {target} ({packaged})")
    if target in DEMO_MODELS:
        model = resolve_model_path(target)  # ValueError with `shardbook fetch NAME` when it is not built yet
        return ConfigSource(model, f"no config file (demo model {target} in {model}, defaults for every setting)")
    raise ValueError(
        f"{target!r} is not a YAML file, a model directory, a packaged config ({', '.join(PACKAGED_CONFIGS)}) "
        f"or a demo model ({', '.join(sorted(DEMO_MODELS))}); `shardbook configs` lists the packaged configs"
    )


def configs_listing() -> str:
    """What ``shardbook configs`` prints: one line per packaged file (its short names, path, what it is for)."""
    names: dict[str, list[str]] = {}
    for name, file in PACKAGED_CONFIGS.items():
        names.setdefault(file, []).append(name)
    folder = packaged_config_dir()
    rows = [(", ".join(aliases), str(folder / file), DESCRIPTIONS.get(file, "")) for file, aliases in names.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(2)]
    lines = [f"{name:<{widths[0]}}  {path:<{widths[1]}}  {what}" for name, path, what in rows]
    return "\n".join(
        [
            *lines,
            "",
            "Use one by name (`shardbook chat --nproc 2 demo`, `%load_sharded demo`), or copy it and edit the copy;",
            "a model directory works in place of a config too (every setting at its default, --section.key overrides).",
        ]
    )
