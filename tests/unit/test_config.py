"""Unit tests of the config: defaults, YAML, overrides, errors, validation
and the shipped files (schema and parsing)."""

import dataclasses
import logging
from pathlib import Path

import pytest

from shardbook.rankd.config.parsing import config_from_dict, load_config, parse_overrides
from shardbook.rankd.config.reference import config_reference_markdown, field_docs
from shardbook.rankd.config.schema import (
    SECTIONS,
    InferenceConfig,
    ModelConfig,
    ParallelConfig,
    ShardbookConfig,
    validate_for_world,
)

CONFIGS = Path(__file__).resolve().parents[2] / "configs"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "x.yaml"
    path.write_text(text)
    return path


def test_defaults_match_generate():
    config = load_config(None)
    assert config == ShardbookConfig()
    assert config.model.dtype == "auto" and config.model.trust_remote_code is False
    assert config.parallel.fsdp_size == -1 and config.parallel.reshard_after_forward is None
    assert config.parallel.decode == "auto"
    assert (config.parallel.ep_size, config.parallel.ep_fsdp_size, config.parallel.device) == (1, 1, "auto")
    inference = config.inference
    assert (inference.infer_backend, inference.max_new_tokens, inference.do_sample) == ("huggingface", 512, False)
    assert (inference.temperature, inference.top_p, inference.top_k, inference.repetition_penalty) == (
        1.0,
        1.0,
        50,
        1.0,
    )
    assert inference.seed is None and inference.system_prompt is None


def test_yaml_values_and_int_to_float(tmp_path):
    path = write(tmp_path, "model:\n  model_name_or_path: /m\ninference:\n  temperature: 2\n  seed: 7\nparallel:\n")
    config = load_config(path)
    assert config.model.model_name_or_path == "/m"
    assert config.inference.temperature == 2.0 and isinstance(config.inference.temperature, float)
    assert config.inference.seed == 7
    assert config.parallel == ParallelConfig()


def test_command_line_beats_yaml_beats_defaults(tmp_path, caplog):
    path = write(tmp_path, "inference:\n  max_new_tokens: 100\n  top_k: 5\n")
    with caplog.at_level(logging.INFO):
        config = load_config(path, ["--inference.max_new_tokens", "7"])
    assert config.inference.max_new_tokens == 7
    assert config.inference.top_k == 5
    assert config.inference.top_p == 1.0
    assert "replaces 100" in caplog.text


def test_typed_overrides():
    config = load_config(
        None,
        [
            "--inference.do_sample",
            "--parallel.fsdp_size=-1",
            "--parallel.reshard_after_forward",
            "no",
            "--inference.temperature",
            "0.5",
            "--inference.seed",
            "none",
            "--inference.system_prompt=Be terse.",
            "--model.trust_remote_code",
        ],
    )
    assert config.inference.do_sample is True
    assert config.parallel.fsdp_size == -1
    assert config.parallel.reshard_after_forward is False and config.parallel.decode == "gather"
    assert config.inference.temperature == 0.5
    assert config.inference.seed is None
    assert config.inference.system_prompt == "Be terse."
    assert config.model.trust_remote_code is True


def test_optional_bool_accepts_null_and_negative_number_is_a_value():
    assert load_config(None, ["--parallel.reshard_after_forward", "null"]).parallel.reshard_after_forward is None
    assert parse_overrides(["--parallel.fsdp_size", "-1"])[0].text == "-1"


@pytest.mark.parametrize(("flag", "layout"), [("true", "reshard"), ("false", "gather")])
def test_mindspeed_reshard_flag_names_a_decode_layout(flag, layout, caplog):
    with caplog.at_level(logging.WARNING):
        config = load_config(None, ["--parallel.reshard_after_forward", flag])
    assert config.parallel.decode == layout
    assert f"parallel.reshard_after_forward={flag}: using parallel.decode {layout}" in caplog.text
    # the same layout named twice is no contradiction, and says nothing more
    caplog.clear()
    assert (
        load_config(None, ["--parallel.reshard_after_forward", flag, "--parallel.decode", layout]).parallel.decode
        == layout
    )
    assert caplog.text == ""


@pytest.mark.parametrize(("flag", "layout"), [("true", "tp"), ("true", "gather"), ("false", "reshard")])
def test_mindspeed_reshard_flag_contradicting_decode_is_an_error(flag, layout):
    with pytest.raises(
        ValueError, match=f"reshard_after_forward={flag} means parallel.decode .* but parallel.decode is {layout}"
    ):
        load_config(None, ["--parallel.reshard_after_forward", flag, "--parallel.decode", layout])


def test_unknown_decode_layout_lists_the_valid_ones():
    with pytest.raises(ValueError, match="auto, tp, gather, reshard"):
        load_config(None, ["--parallel.decode", "sharded"])


def test_repeated_override_warns(caplog):
    config = load_config(None, ["--inference.top_k", "3", "--inference.top_k=4"])
    assert config.inference.top_k == 4
    assert "given twice" in caplog.text


def test_sampling_settings_without_do_sample_warn(tmp_path, caplog):
    load_config(write(tmp_path, "inference:\n  temperature: 0.7\n"))
    assert "inference.temperature ignored" in caplog.text


@pytest.mark.parametrize(
    "tokens, words",
    [
        (["--inference.max_new_tokens", "many"], ["'many'", "inference.max_new_tokens", "expected int"]),
        (["--inference.do_sample=maybe"], ["'maybe'", "inference.do_sample", "expected bool"]),
        (["--inference.top_p", "high"], ["'high'", "inference.top_p", "expected float"]),
        (["--parallel.fsdp_size", "none"], ["'none'", "parallel.fsdp_size", "expected int"]),
        (["--inference.seed", "1.5"], ["'1.5'", "inference.seed", "expected int or null"]),
        (["--parallel.fsdp_size"], ["--parallel.fsdp_size needs a value"]),
        (["inference.top_k=3"], ["unexpected argument", "--section.key value"]),
        (["--top_k", "3"], ["must name section.key"]),
    ],
)
def test_bad_override_values(tokens, words):
    with pytest.raises(ValueError) as error:
        load_config(None, tokens)
    for word in words:
        assert word in str(error.value)


@pytest.mark.parametrize(
    "text, words",
    [
        ("inference:\n  max_new_tokens: lots\n", ["'lots'", "inference.max_new_tokens", "expected int", "x.yaml"]),
        ("inference:\n  system_prompt: [a, b]\n", ["inference.system_prompt", "expected str or null", "got list"]),
        ("model:\n  trust_remote_code: 3\n", ["model.trust_remote_code", "expected bool", "got int"]),
        ("parallel:\n  fsdp_size: true\n", ["parallel.fsdp_size", "expected int", "got bool"]),
    ],
)
def test_bad_yaml_values(tmp_path, text, words):
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, text))
    for word in words:
        assert word in str(error.value)


def test_quoted_numbers_and_pyyaml_exponents_are_parsed(tmp_path):
    config = load_config(write(tmp_path, "inference:\n  temperature: 1e-2\n  top_k: '8'\n"))
    assert (config.inference.temperature, config.inference.top_k) == (0.01, 8)


def test_unknown_key_in_yaml(tmp_path):
    with pytest.raises(ValueError) as error:
        load_config(write(tmp_path, "inference:\n  max_new_token: 5\n"))
    message = str(error.value)
    assert "unknown key 'inference.max_new_token'" in message and "x.yaml" in message
    assert "did you mean 'inference.max_new_tokens'?" in message
    assert "Valid keys of [inference]: " + ", ".join(f.name for f in dataclasses.fields(InferenceConfig)) in message


def test_unknown_key_in_override_suggests_other_section():
    with pytest.raises(ValueError) as error:
        load_config(None, ["--model.max_new_tokens", "5"])
    message = str(error.value)
    assert "unknown key 'model.max_new_tokens' on the command line" in message
    assert "did you mean 'inference.max_new_tokens'?" in message
    assert "Valid keys of [model]: model_name_or_path, dtype, trust_remote_code" in message


def test_unknown_key_without_close_match():
    with pytest.raises(
        ValueError, match=r"unknown key 'parallel.zzz' on the command line\. Valid keys of \[parallel\]"
    ):
        load_config(None, ["--parallel.zzz", "1"])


@pytest.mark.parametrize("where", ["yaml", "override"])
def test_unknown_section(tmp_path, where):
    with pytest.raises(ValueError) as error:
        if where == "yaml":
            load_config(write(tmp_path, "infernce:\n  top_k: 1\n"))
        else:
            load_config(None, ["--infernce.top_k", "1"])
    message = str(error.value)
    assert "unknown section 'infernce'" in message
    assert "did you mean 'inference'?" in message
    assert "Valid sections: model, parallel, inference" in message


def test_mindspeed_sections_and_keys_are_ignored_with_a_warning(tmp_path, caplog):
    text = (
        "model:\n  model_id: glm\n  model_name_or_path: /m\n"
        "parallel:\n  tp_size: 1\n  fsdp_size: 2\n"
        "training:\n  lr: 1.0e-5\n  optimizer: adamw\n"
        "data:\n  template: qwen3\n"
    )
    with caplog.at_level(logging.WARNING, logger="shardbook.rankd.config.schema"):
        config = load_config(write(tmp_path, text))
    assert config.parallel.fsdp_size == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    for name in ("training", "data", "model.model_id", "parallel.tp_size"):
        assert name in warnings[0]


def test_training_override_is_an_error():
    with pytest.raises(ValueError, match="unknown section 'training'"):
        load_config(None, ["--training.lr", "1"])


def test_yaml_syntax_error_names_file_and_line(tmp_path):
    path = write(tmp_path, "model:\n  dtype: float32\ninference:\n  max_new_tokens: [1, 2\n  top_k: 3\n")
    with pytest.raises(ValueError) as error:
        load_config(path)
    message = str(error.value)
    assert str(path) in message
    assert "line 5" in message and "column" in message


def test_duplicate_yaml_key_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"line 3.*duplicate key 'top_k'"):
        load_config(write(tmp_path, "inference:\n  top_k: 1\n  top_k: 2\n"))


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("text", ["- model\n- parallel\n", "just text\n"])
def test_top_level_must_be_a_mapping(tmp_path, text):
    with pytest.raises(ValueError, match="must hold a mapping of sections"):
        load_config(write(tmp_path, text))


def test_section_must_be_a_mapping(tmp_path):
    with pytest.raises(ValueError, match="section 'model' .* must be a mapping"):
        load_config(write(tmp_path, "model: smollm2-135m-instruct\n"))


def test_empty_file_gives_defaults(tmp_path):
    assert load_config(write(tmp_path, "# nothing yet\n")) == ShardbookConfig()


def test_fsdp_size_must_divide_world():
    with pytest.raises(ValueError) as error:
        load_config(None, ["--parallel.fsdp_size", "3"], world_size=8)
    message = str(error.value)
    assert "fsdp_size=3" in message and "world size 8" in message
    assert "1, 2, 4, 8" in message
    validate_for_world(load_config(None, ["--parallel.fsdp_size", "4"]), 8)
    validate_for_world(ShardbookConfig(), 5)


def test_fsdp_size_resolves_against_the_world():
    assert ParallelConfig().fsdp_size_for(32) == 32
    assert ParallelConfig(fsdp_size=8).fsdp_size_for(32) == 8


@pytest.mark.parametrize("fsdp_size", [0, -2])
def test_fsdp_size_must_be_minus_one_or_positive(fsdp_size):
    with pytest.raises(ValueError, match="-1 .*or a positive number of ranks"):
        ParallelConfig(fsdp_size=fsdp_size)


@pytest.mark.parametrize("key", ["ep_size", "ep_fsdp_size"])
def test_expert_parallel_sizes_must_be_positive(key):
    with pytest.raises(ValueError, match="must be >= 1"):
        load_config(None, [f"--parallel.{key}", "0"])


def test_expert_parallel_must_divide_the_world():
    assert load_config(None, ["--parallel.ep_size", "2"], world_size=2).parallel.ep_size == 2
    with pytest.raises(
        ValueError, match=r"world size 2 is not divisible by parallel.ep_size x parallel.ep_fsdp_size = 3 x 1"
    ):
        load_config(None, ["--parallel.ep_size", "3"], world_size=2)


@pytest.mark.parametrize("layout", ["gather", "reshard"])
def test_expert_parallel_runs_in_the_tp_layout(layout):
    with pytest.raises(
        ValueError, match=f"expert parallelism, which runs in the tp layout, but parallel.decode is {layout}"
    ):
        load_config(None, ["--parallel.ep_size", "2", "--parallel.decode", layout])


@pytest.mark.parametrize(
    "kwargs, words",
    [
        ({"temperature": 0}, "temperature must be > 0"),
        ({"top_p": 0}, r"top_p must be in \(0, 1\]"),
        ({"top_p": 1.5}, r"top_p must be in \(0, 1\]"),
        ({"top_p": float("nan")}, r"top_p must be in \(0, 1\]"),
        ({"top_k": -1}, "top_k must be >= 0"),
        ({"max_new_tokens": 0}, "max_new_tokens must be >= 1"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"infer_backend": "vllm"}, "infer_backend must be one of huggingface"),
    ],
)
def test_inference_validation(kwargs, words):
    with pytest.raises(ValueError, match=words):
        InferenceConfig(**kwargs)


def test_choices_suggest_the_right_spelling():
    with pytest.raises(ValueError, match="did you mean 'bfloat16'"):
        ModelConfig(dtype="bf16")
    with pytest.raises(ValueError, match="device must be one of auto, cpu, cuda, npu; got 'gpu'; did you mean 'cuda'"):
        ParallelConfig(device="gpu")


def test_direct_construction_is_type_checked():
    with pytest.raises(ValueError, match="invalid value 2.5 for inference.top_k: expected int"):
        InferenceConfig(top_k=2.5)


def test_to_dict_round_trip_and_describe():
    config = load_config(None, ["--inference.do_sample", "--parallel.fsdp_size", "2"])
    data = config.to_dict()
    assert data["parallel"]["fsdp_size"] == 2 and data["inference"]["do_sample"] is True
    assert config_from_dict(data) == config
    lines = config.describe().splitlines()
    assert len(lines) == 3
    assert "smollm2-135m-instruct" in lines[0] and "fsdp_size=2" in lines[1] and "sampling" in lines[2]


def test_overrides_must_be_a_list():
    with pytest.raises(ValueError, match="list of tokens"):
        load_config(None, "--inference.top_k 3")


@pytest.mark.parametrize(
    "name, world_sizes",
    [
        ("smollm2-135m.yaml", [1, 2]),
        ("qwen-8rank.yaml", [8]),
        ("glm-744b-npu.yaml", [32]),
        ("glm-744b-fp8-npu.yaml", [32]),
    ],
)
def test_shipped_configs_load(name, world_sizes, caplog):
    for world_size in world_sizes:
        config = load_config(CONFIGS / name, [], world_size=world_size)
        assert config.parallel.fsdp_size_for(world_size) == world_size
    assert [r.levelno for r in caplog.records if r.levelno >= logging.WARNING] == (
        [logging.WARNING] if name == "glm-744b-npu.yaml" else []  # its MindSpeed training section
    )


def test_shipped_configs_say_what_they_are_for():
    smollm2 = load_config(CONFIGS / "smollm2-135m.yaml")
    assert (smollm2.model.model_name_or_path, smollm2.model.dtype) == ("smollm2-135m-instruct", "fastest")
    assert smollm2.inference.max_new_tokens == 128 and smollm2.parallel.decode == "auto"
    glm = load_config(CONFIGS / "glm-744b-npu.yaml")
    assert (glm.parallel.device, glm.model.dtype, glm.parallel.fsdp_size) == ("npu", "bfloat16", 32)
    assert glm.parallel.decode == "tp" and glm.parallel.reshard_after_forward is None
    assert (glm.parallel.ep_size, glm.parallel.ep_fsdp_size) == (16, 2)
    with pytest.raises(ValueError, match="does not divide the world size 12"):
        load_config(CONFIGS / "qwen-8rank.yaml", world_size=12)


def test_every_field_is_documented_and_in_the_reference():
    table = config_reference_markdown()
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            assert docs.get(f.name), f"{cls.__name__}.{f.name} has no docstring"
            assert f"| {section} | `{f.name}` |" in table
            assert docs[f.name].replace("|", "\\|") in table
    assert set(field_docs(ShardbookConfig)) == set(SECTIONS)
    assert "| parallel | `reshard_after_forward` | bool or null | `null` |" in table
    assert "| parallel | `decode` | str | `auto` |" in table
    assert "| inference | `max_new_tokens` | int | `512` |" in table


def test_generation_request_defaults_are_the_inference_sections():
    """One set of defaults: a request without settings generates as an empty `inference` section says."""
    from shardbook.rankd.generation.engine import GenerationRequest  # torch and transformers: imported here only

    request, inference = GenerationRequest(messages=[{"role": "user", "content": "Hi"}]), InferenceConfig()
    shared = [f.name for f in dataclasses.fields(GenerationRequest) if hasattr(inference, f.name)]
    assert len(shared) == 7
    assert {name: getattr(request, name) for name in shared} == {name: getattr(inference, name) for name in shared}


def test_prefix_cache_share_is_a_share():
    assert load_config(None, ["--inference.prefix_cache_share", "0"]).inference.prefix_cache_share == 0
    with pytest.raises(ValueError, match=r"inference.prefix_cache_share must be in \[0, 1\] \(0 turns prefix reuse"):
        load_config(None, ["--inference.prefix_cache_share", "1.5"])


def test_parser_keys_take_the_parsers_names_and_list_them_when_wrong(tmp_path):
    config = load_config(
        write(tmp_path, "inference:\n  tool_call_parser: hermes\n"), ["--inference.reasoning_parser", "none"]
    )
    assert (config.inference.reasoning_parser, config.inference.tool_call_parser) == ("none", "hermes")
    assert (InferenceConfig().reasoning_parser, InferenceConfig().tool_call_parser) == ("auto", "auto")
    with pytest.raises(
        ValueError,
        match="reasoning_parser must be one of auto, think, harmony, none; got 'thinks'; did you mean 'think'",
    ):
        load_config(None, ["--inference.reasoning_parser", "thinks"])
    with pytest.raises(
        ValueError, match="inference.tool_call_parser must be one of auto, none, hermes, glm45, .*harmony; got 'qwen3'"
    ):
        InferenceConfig(tool_call_parser="qwen3")
