"""The config reference generated from the field docstrings (the README's table comes from here)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import textwrap

from shardbook.rankd.config.schema import SECTIONS, type_name, yaml_text


def field_docs(cls: type) -> dict[str, str]:
    """The docstring written under each field of dataclass `cls`, read from its source with `ast`."""
    names = {f.name for f in dataclasses.fields(cls)}
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        documented = isinstance(after, ast.Expr) and isinstance(getattr(after.value, "value", None), str)
        named = isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id in names
        if named and documented:
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def config_reference_markdown() -> str:
    """A markdown table of every config key: section, key, type, default and description."""
    rows = ["| Section | Key | Type | Default | Description |", "|---|---|---|---|---|"]
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            description = docs[f.name].replace("|", "\\|")
            default = yaml_text(f.default)
            rows.append(f"| {section} | `{f.name}` | {type_name(f.type)} | `{default}` | {description} |")
    return "\n".join(rows) + "\n"
