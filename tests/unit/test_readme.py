"""The README and the docs stay true: the README opens with the two setup commands, and the config
reference in docs/configuration.md is the one generated from the field docstrings."""

from pathlib import Path

from shardbook.rankd.config.reference import config_reference_markdown

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_configuration_page_table_is_generated_from_the_docstrings():
    assert config_reference_markdown() in CONFIGURATION.read_text()


def test_readme_opens_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].startswith("bash .ci/setup && .venv/bin/shardbook ")
    assert block[1].startswith(".venv/bin/python -m pytest")


def test_readme_links_every_docs_page():
    readme = README.read_text()
    for page in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, f"README.md does not link docs/{page.name}"
