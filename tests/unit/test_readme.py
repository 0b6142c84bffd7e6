"""The README stays true: its config table is the one generated from the field docstrings."""

from pathlib import Path

from shardbook.rankd.config.reference import config_reference_markdown

README = Path(__file__).resolve().parents[2] / "README.md"


def test_readme_config_table_is_generated_from_the_docstrings():
    assert config_reference_markdown() in README.read_text()


def test_readme_opens_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    block = lines[lines.index("```bash") + 1 : lines.index("```bash") + 3]
    assert block[0].startswith("bash .ci/setup && .venv/bin/shardbook ")
    assert block[1].startswith(".venv/bin/python -m pytest")
