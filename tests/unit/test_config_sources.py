"""What the CONFIG argument may be: a YAML file, a model directory, a packaged config's short name, a demo model
name or nothing; `shardbook configs`; and the one-line errors for a missing extra."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shardbook.kernel.api import fetch
from shardbook.kernel.api.configs import PACKAGED_CONFIGS, configs_listing, packaged_configs, resolve_config
from shardbook.kernel.api.load import prepare_load
from shardbook.kernel.cli.main import main, missing_extra, split_leading_overrides
from shardbook.rankd.config.parsing import load_config
from shardbook.rankd.config.schema import ShardbookConfig
from shardbook.rankd.control.world import detect_device

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "llama"}))
    return model


def test_a_model_directory_takes_every_default_and_the_overrides(model_dir):
    config = load_config(model_dir, ["--parallel.decode", "tp"])
    assert config.model.model_name_or_path == str(model_dir)
    assert config.parallel.decode == "tp"
    defaults = ShardbookConfig()
    assert (config.inference, config.model.dtype) == (defaults.inference, defaults.model.dtype)
    assert load_config(model_dir, ["--model.model_name_or_path", "/else"]).model.model_name_or_path == "/else"


def test_prepare_load_with_a_directory_says_no_config_file(model_dir):
    config, model_path, source = prepare_load(str(model_dir), ["--inference.max_new_tokens", "7"], 2)
    assert model_path == model_dir and config.inference.max_new_tokens == 7
    assert source.description.startswith("no config file") and str(model_dir) in source.description


def test_no_config_at_all_with_the_model_on_the_command_line(model_dir):
    config, model_path, source = prepare_load(None, ["--model.model_name_or_path", str(model_dir)], 1)
    assert model_path == model_dir and source.path is None
    assert source.description.startswith("no config file")


def test_a_yaml_file_wins_and_is_named(tmp_path, model_dir):
    path = tmp_path / "mine.yaml"
    path.write_text(f"model:\n  model_name_or_path: {model_dir}\ninference:\n  max_new_tokens: 9\n")
    config, _, source = prepare_load(str(path), [], 1)
    assert config.inference.max_new_tokens == 9 and source.description == f"config file {path}"


def test_short_names_are_the_packaged_files(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no file of that name here
    configs = packaged_configs()
    assert set(configs) == {"demo", "smollm2-135m", "qwen-8rank", "glm-744b-npu", "glm-744b-fp8-npu"}
    assert configs["demo"] == configs["smollm2-135m"] == ROOT / "configs" / "smollm2-135m.yaml"  # editable install
    for name, file in PACKAGED_CONFIGS.items():
        source = resolve_config(name)
        assert source.path == configs[name] and source.path.is_file() and source.path.name == file
        assert source.description.startswith(f"packaged config {name} (")
    assert load_config(resolve_config("demo").path).model.model_name_or_path == "smollm2-135m-instruct"


def test_an_existing_path_wins_over_a_short_name(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "demo").mkdir()
    assert resolve_config("demo").path == Path("demo")


def test_a_demo_model_name_is_its_built_directory(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("SHARDBOOK_HOME", str(tmp_path / "home"))
    with pytest.raises(ValueError, match="shardbook fetch smollm2-135m-instruct"):
        resolve_config("smollm2-135m-instruct")
    built = tmp_path / "home" / "models" / "smollm2-135m-instruct"
    built.mkdir(parents=True)
    (built / fetch.COMPLETE_MARKER).write_text("{}")
    source = resolve_config("smollm2-135m-instruct")
    assert source.path == built and source.description.startswith("no config file (demo model")


def test_a_name_that_is_nothing_lists_the_choices(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"not a YAML file, a model directory, a packaged config \(demo, "):
        resolve_config("dmeo")


def test_shardbook_configs_lists_names_paths_and_how_to_use_them(capsys):
    assert main(["configs"]) == 0
    out = capsys.readouterr().out
    assert out == configs_listing() + "\n"
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["demo,", "smollm2-135m", str(ROOT / "configs" / "smollm2-135m.yaml")]
    assert lines[1].split()[:2] == ["qwen-8rank", str(ROOT / "configs" / "qwen-8rank.yaml")]
    assert lines[2].split()[:2] == ["glm-744b-npu", str(ROOT / "configs" / "glm-744b-npu.yaml")]
    assert "shardbook chat --nproc 2 demo" in out


def test_fetch_without_the_demo_extra_says_so_in_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SHARDBOOK_HOME", str(tmp_path))
    real = fetch.importlib.util.find_spec
    monkeypatch.setattr(fetch.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    assert main(["fetch", "smollm2-135m-instruct"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "demo extra" in err and "pip install 'shardbook[demo]'" in err, err
    assert "gguf is not installed" in err


def test_device_npu_without_torch_npu_names_the_npu_extra(model_dir):
    with pytest.raises(ValueError, match=r"torch_npu is not installed: pip install 'shardbook\[npu\]'"):
        detect_device("npu")
    with pytest.raises(ValueError, match=r"shardbook\[npu\]"):  # before any rank starts
        prepare_load(str(model_dir), ["--parallel.device", "npu"], 2)


def test_an_import_error_of_an_extra_names_it():
    assert "pip install 'shardbook[test]'" in missing_extra(ModuleNotFoundError("x", name="pexpect"))
    assert "pip install 'shardbook[demo]'" in missing_extra(ModuleNotFoundError("x", name="gguf.constants"))
    assert missing_extra(ModuleNotFoundError("x", name="numpy")) is None


def test_chat_and_serve_take_overrides_without_a_config(capsys):
    assert split_leading_overrides(["chat", "--nproc", "2", "--model.model_name_or_path", "X", "--x.y", "1"]) == (
        ["chat", "--nproc", "2"],
        ["--model.model_name_or_path", "X", "--x.y", "1"],
    )
    assert split_leading_overrides(["chat", "--nproc", "2", "demo", "--x.y", "1"])[1] is None
    assert split_leading_overrides(["serve", "--port", "8001", "--model.model_name_or_path=X"])[1] == [
        "--model.model_name_or_path=X"
    ]
    for command in ("chat", "serve"):
        with pytest.raises(SystemExit) as exit_:
            main([command, "--nproc", "2", "--model.model_name_or_path", "/nonexistent"])
        assert exit_.value.code == 2
        assert "model path '/nonexistent' does not exist" in capsys.readouterr().err
