"""Packaging stays honest: version ranges, no unused dependencies, bounds where private APIs are used, own docs."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import tomllib
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]
PACKAGE_DIRS = ("shardbook", "kernel", "magics", "rankd")
IMPORT_NAMES = {"pyzmq": "zmq", "pyyaml": "yaml", "ipython": "IPython"}
OPTIONAL_IMPORTS = {"shardbook", "torch_npu"}  # the package itself; the npu extra
# A private name the package uses -> the distribution that must carry an upper bound for it.
PRIVATE_USES = {
    "._non_persistent_buffers_set": "torch",
    "._topic(": "ipykernel",
    "._showtraceback": "ipython",
    "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES": "transformers",
}


def requirements() -> dict[str, Requirement]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return {Requirement(line).name.lower(): Requirement(line) for line in project["dependencies"]}


def package_sources() -> dict[Path, str]:
    return {path: path.read_text() for folder in PACKAGE_DIRS for path in sorted((ROOT / folder).rglob("*.py"))}


def imported_modules() -> set[str]:
    names = set()
    for path, source in package_sources().items():
        for node in ast.walk(ast.parse(source, str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return names


def test_torch_is_a_range_and_the_exact_pin_is_only_in_ci_setup():
    torch = requirements()["torch"]
    operators = {spec.operator for spec in torch.specifier}
    assert operators == {">=", "<"}, torch
    assert re.search(r"pip install \S* ?torch==\d+\.\d+\.\d+", (ROOT / ".ci" / "setup").read_text())


def test_every_dependency_is_imported_by_the_package():
    imported = imported_modules()
    unused = [name for name in requirements() if IMPORT_NAMES.get(name, name) not in imported]
    assert unused == [], f"declared but never imported: {unused}"


def test_every_third_party_import_is_declared():
    declared = {IMPORT_NAMES.get(name, name.replace("-", "_")) for name in requirements()}
    third_party = imported_modules() - set(sys.stdlib_module_names) - OPTIONAL_IMPORTS
    assert sorted(third_party - declared) == [], "imported but not in [project].dependencies"


def test_private_apis_in_use_have_an_upper_bound():
    sources = "\n".join(package_sources().values())
    reqs = requirements()
    for marker, dist in PRIVATE_USES.items():
        if marker in sources:
            assert "<" in {spec.operator for spec in reqs[dist].specifier}, f"{marker} is used: bound {dist} above"


def test_readme_links_the_projects_own_architecture_page():
    readme = (ROOT / "README.md").read_text()
    assert "../shared" not in readme
    assert "(docs/architecture.md)" in readme
    page = (ROOT / "docs" / "architecture.md").read_text()
    assert "../shared" not in page
    for module in re.findall(r"`((?:kernel|magics|rankd)/[\w/]+\.py)`", page):  # modules the page names exist
        assert (ROOT / module).is_file(), module
