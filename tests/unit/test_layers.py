"""The import rules of the source tree: `magics -> kernel -> rankd`, layers inside each, and no cycles.

Every import counts, at module level, inside functions and under `TYPE_CHECKING` alike: a lazy import
that points the wrong way is still a dependency the wrong way.
"""

from __future__ import annotations

import ast
from functools import cache
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[2]
TOPS = {"rankd": 0, "kernel": 1, "magics": 2, "shardbook": 3}
"""The installed packages by folder, lowest first (`shardbook/` holds only `python -m shardbook`)."""
LAYERS = {
    "rankd": ["control", "config", "parallel", "loading", "generation", "inspection", "commands"],
    "kernel": ["ranks", "api", "server", "slurm", "cli"],
    "magics": ["views"],
}
"""Subpackages, lowest first; a folder's own top-level modules (`kernel/app.py`, `rankd/__main__.py`) sit above them."""


DATA_PACKAGES = {"shardbook.configs"}
"""Installed packages that hold data, not code (`configs/`: the packaged YAML files and a docstring)."""


def module_name(path: Path) -> str:
    top, *rest = path.relative_to(ROOT).with_suffix("").parts
    parts = [part for part in rest if part != "__init__"]
    return ".".join(["shardbook"] + ([] if top == "shardbook" else [top]) + parts)


@cache
def modules() -> dict[str, Path]:
    return {module_name(path): path for top in TOPS for path in sorted((ROOT / top).rglob("*.py"))}


def imported_names(name: str, path: Path) -> set[str]:
    """The shardbook modules `name` imports anywhere in its source (relative imports resolved)."""
    found = set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            found.update(
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules() else base for alias in node.names
            )
    return {target for target in found if target in modules() and target != name}


@cache
def import_graph() -> dict[str, set[str]]:
    return {name: imported_names(name, path) for name, path in modules().items()}


def rank_of(name: str) -> tuple[int, int]:
    """(folder, layer) of a module: it may import what ranks at or below it in its folder, or any lower folder."""
    parts = name.split(".")
    top = parts[1] if len(parts) > 1 and parts[1] in LAYERS else "shardbook"
    layers = LAYERS.get(top, [])
    sub = parts[2] if len(parts) > 2 else None
    return TOPS[top], layers.index(sub) if sub in layers else len(layers)


def test_imports_point_down_the_layers():
    wrong = [
        f"{name} -> {target}"
        for name, targets in import_graph().items()
        for target in sorted(targets)
        if rank_of(target)[0] > rank_of(name)[0]
        or (rank_of(target)[0] == rank_of(name)[0] and rank_of(target) > rank_of(name))
    ]
    assert wrong == [], "imports that point up a layer:\n" + "\n".join(wrong)


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iteratively)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(root: str) -> None:
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return found


def test_no_module_imports_in_a_cycle():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_every_layer_is_a_package_with_its_rules_and_every_package_is_installed():
    packages = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    assert DATA_PACKAGES <= packages
    packages -= DATA_PACKAGES
    found = {module_name(path.parent / "__init__.py") for top in TOPS for path in (ROOT / top).rglob("__init__.py")}
    assert found == packages
    for top, layers in LAYERS.items():
        for layer in layers:
            doc = ast.get_docstring(ast.parse((ROOT / top / layer / "__init__.py").read_text())) or ""
            assert "import" in doc, f"{top}/{layer}/__init__.py does not say what it may import"
