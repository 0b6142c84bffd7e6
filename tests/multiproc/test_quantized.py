"""Quantized checkpoints on 2 gloo ranks, in the formats the official weights ship (see `tests.quantized`).

Each checkpoint's reference is its float32 twin (every quantized weight replaced by the exact dequantization of
its codes) loaded by transformers in one process: logits within |a - b| <= 1e-4 (1 + |b|) on every rank under
`gather`, `reshard` and `tp`, and `tp` with `ep_size 2` for those with experts. The FP8 blocks are 32 x 32 on
weights of 24, 80, ... rows, so grids are rounded up (partial last blocks) and the ranks' slices start and end
inside blocks: 5 query heads split 3 and 2 under `tp`, FSDP2 splits rows in halves, experts split 4 and 4.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids
from tests.multiproc.test_mla import close
from tests.multiproc.test_reload import rank_context
from tests.quantized import write_quantized
from tests.tiny import DEEPSEEK_V4, make_tiny_lm, make_tiny_mla, make_tiny_tp_family

pytestmark = pytest.mark.timeout(600)


def five_heads(path: Path) -> Path:
    """A float32 Llama of 5 query heads over 1 KV head, split 3 and 2 under `tp`, on 80 columns (partial blocks)."""
    return make_tiny_lm(path, family="llama", hidden_size=80, num_heads=5, num_kv_heads=1)


CHECKPOINTS = {
    # name: (how the float32 model is made, its format, whether it has experts, a weight to gather whole)
    "llama-fp8-blocks": (
        five_heads,
        "fp8-blocks",
        False,
        "model.layers.0.self_attn.q_proj.weight",
    ),
    "llama-fp8-tensor": (
        five_heads,
        "fp8-tensor",
        False,
        "model.layers.0.self_attn.o_proj.weight",
    ),
    "deepseek-v3.1-fp8-ue8m0": (
        lambda p: make_tiny_mla(p, "deepseek_v3"),
        "fp8-ue8m0",
        True,
        "model.layers.0.self_attn.kv_a_proj_with_mqa.weight",
    ),
    "minimax-m2-fp8": (
        lambda p: make_tiny_tp_family(p, "minimax_m2"),
        "fp8-minimax",
        True,
        "model.layers.1.mlp.experts.gate_up_proj",
    ),
    "gpt-oss-mxfp4": (
        lambda p: make_tiny_tp_family(p, "gpt_oss"),
        "mxfp4",
        True,
        "model.layers.1.mlp.experts.down_proj",
    ),
    "kimi-k2-thinking-int4": (
        lambda p: make_tiny_mla(p, "deepseek_v3"),
        "int4-pack",
        True,
        "model.layers.1.mlp.experts.gate_up_proj",
    ),
    "deepseek-v4-fp4-experts": (
        lambda p: make_tiny_lm(p, family="deepseek_v4", **DEEPSEEK_V4),
        "deepseek-v4",
        True,
        "model.layers.1.mlp.experts.gate_up_proj",
    ),
    "llama-fp8-channel": (
        five_heads,
        "fp8-channel",
        False,
        "model.layers.1.mlp.down_proj.weight",
    ),
}
LAYOUTS = {
    "gather": {"decode": "gather"},
    "reshard": {"decode": "reshard"},
    "tp": {"decode": "tp"},
    "tp-ep2": {"decode": "tp", "ep_size": 2},
}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict:
    """name -> (quantized path, its reference logits, the reference of its named weight, experts?)."""
    return {name: make_checkpoint(name, tmp_path_factory.mktemp(name)) for name in CHECKPOINTS}


def make_checkpoint(name: str, root: Path) -> tuple:
    """`CHECKPOINTS[name]` written under `root`: its path, its reference logits and weight, whether it has experts."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make, fmt, experts, weight = CHECKPOINTS[name]
    quantized, twin = write_quantized(make(root / "float32"), root / "model", fmt)
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(prompt_ids(AutoTokenizer.from_pretrained(twin))).logits
    return quantized, logits, model.get_parameter(weight).detach().clone(), experts


def load_each(rank: int, paths: dict, parallel: dict) -> dict:
    """Every checkpoint in turn on one process group: logits, the summary, one weight gathered whole on rank 0."""
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    results = {}
    for name, (path, weight) in paths.items():
        config = ShardbookConfig(
            model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
        )
        loaded = load_sharded(config, device="cpu")
        with torch.no_grad():
            logits = loaded.model(prompt_ids(loaded.tokenizer)).logits
        whole = full_parameter_on_rank0(loaded.model, loaded.model.get_parameter(weight))
        results[name] = {"logits": logits, "summary": loaded.summary, "whole": whole}
    return results


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_quantized_checkpoints_match_their_dequantization(ranks, checkpoints, layout):
    parallel = LAYOUTS[layout]
    wanted = {
        n: (path, CHECKPOINTS[n][3])
        for n, (path, _, _, experts) in checkpoints.items()
        if experts or "ep_size" not in parallel
    }
    per_rank = ranks(load_each, wanted, parallel, deadline=500)
    for name in wanted:
        _, reference, weight, _ = checkpoints[name]
        for rank, results in enumerate(per_rank):
            close(results[name]["logits"], reference, f"{name} under {layout}, rank {rank}")
        # full_parameter joins the ranks' dequantized slices into the weight's exact dequantization
        torch.testing.assert_close(per_rank[0][name]["whole"], weight, atol=0, rtol=0, msg=name)
        summary = per_rank[0][name]["summary"]
        assert summary["decode"] == parallel["decode"], (name, summary["decode"])
        assert summary["quantized_tensors"], name
        assert summary["checkpoint_bytes"] < summary["full_param_bytes"], name  # codes are smaller than float32


def test_each_format_is_named_in_the_summary(ranks, checkpoints):
    from shardbook.magics.views.tables import quantized_line

    paths = {n: (checkpoints[n][0], CHECKPOINTS[n][3]) for n in ("gpt-oss-mxfp4", "kimi-k2-thinking-int4")}
    results = ranks(load_each, paths, {"decode": "gather"}, deadline=300)[0]
    gpt_oss = results["gpt-oss-mxfp4"]["summary"]
    assert gpt_oss["quantized_tensors"] == {"mxfp4 e2m1, 1x32 blocks": 4}  # 2 layers x gate_up, down
    kimi = results["kimi-k2-thinking-int4"]["summary"]
    # 1 MoE layer x 8 experts x (gate, up, down); the dense first layer and the shared expert stay float
    assert kimi["quantized_tensors"] == {"compressed-tensors int4, groups of 32": 24}
    line = quantized_line(gpt_oss)
    assert line.startswith("4 tensor(s) in mxfp4 e2m1, 1x32 blocks, dequantized to float32;") and "on disk" in line


def _broken(root: Path, source: Path) -> dict[str, Path]:
    """A missing scale tensor, a scale grid that does not fit, and an unsupported method, each from `source`."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    cases = {}
    state = load_file(source / "model.safetensors")
    config = json.loads((source / "config.json").read_text())
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    edits = {
        "missing scale": ({k: v for k, v in state.items() if k != scale}, config),
        "grid that does not fit": ({**state, scale: state[scale][:, :1].contiguous()}, config),
        "unsupported method": (state, {**config, "quantization_config": {"quant_method": "gptq", "bits": 4}}),
    }
    for case, (tensors, cfg) in edits.items():
        cases[case] = shutil.copytree(source, root / case.replace(" ", "-"))
        save_file(tensors, cases[case] / "model.safetensors")
        (cases[case] / "config.json").write_text(json.dumps(cfg))
    return cases


EXPECTED_ERRORS = {
    "missing scale": "but not model.layers.0.self_attn.q_proj.weight_scale_inv",
    "grid that does not fit": "needs a scale grid of [3, 3] (ceil(shape / block))",
    "unsupported method": "quant_method 'gptq', which sharded loading does not read",
}


def reload_broken(rank: int, good: Path, broken: dict[str, Path]) -> dict:
    """Load `good`, then try each broken checkpoint: the errors, and the first model's logits after them."""
    from shardbook.rankd.loading.reload import replace_model
    from tests.multiproc.test_loading import stand_in_config

    ctx = rank_context(rank)

    def reload(path):
        try:
            replace_model(
                ctx, stand_in_config(path), device="cpu", model_path=None, progress=None, notice=lambda _: None
            )
        except ValueError as e:
            return str(e)
        return "loaded"

    assert reload(good) == "loaded"
    first = ctx.state["loaded"].model
    errors = {case: reload(path) for case, path in broken.items()}
    with torch.no_grad():
        logits = first(prompt_ids(ctx.shell.user_ns["tokenizer"])).logits
    return {"errors": errors, "kept": ctx.state["loaded"].model is first, "logits": logits}


def test_broken_quantized_checkpoints_are_refused_on_every_rank_and_the_model_stays(ranks, checkpoints, tmp_path):
    good, reference = checkpoints["llama-fp8-blocks"][:2]
    results = ranks(reload_broken, good, _broken(tmp_path, good), deadline=300)
    for rank, result in enumerate(results):
        for case, expected in EXPECTED_ERRORS.items():
            assert expected in result["errors"][case], (rank, case, result["errors"][case])
        assert result["kept"], rank
        close(result["logits"], reference, f"rank {rank} after the refused loads")


def load_bfloat16(rank: int, path: Path, decode: str) -> torch.Tensor:
    from shardbook.rankd.loading.load_sharded import load_sharded
    from tests.multiproc.test_loading import stand_in_config

    loaded = load_sharded(stand_in_config(path, dtype="bfloat16", decode=decode), device="cpu")
    with torch.no_grad():
        return loaded.model(prompt_ids(loaded.tokenizer)).logits.float()


@pytest.mark.parametrize("decode", ["gather", "tp"])
def test_fp8_dequantized_to_bfloat16_with_a_float32_router(ranks, checkpoints, decode):
    """DeepSeek's router weight stays float32 in a bf16 model: FSDP2 gathers it as a group of its own."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = checkpoints["deepseek-v3.1-fp8-ue8m0"][0]
    twin = path.with_name(path.name + "-reference")
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        reference = model(prompt_ids(AutoTokenizer.from_pretrained(twin))).logits.float()
    for rank, logits in enumerate(ranks(load_bfloat16, path, decode)):
        # bf16 partial sums rounded in another order (tp all-reduces them): a few bf16 ulps at logits up to 7,
        # where raw fp8 codes would be off by 2 or more
        torch.testing.assert_close(logits, reference, atol=0.15, rtol=0, msg=f"rank {rank}")


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def peak_memory_of_the_read(rank: int, path: Path) -> dict:
    """Resident memory added by the read step of a `reshard` load, at its peak (VmHWM, reset just before)."""
    from shardbook.rankd.loading import load_sharded as module
    from shardbook.rankd.loading.summary import local_param_bytes
    from tests.multiproc.test_loading import stand_in_config

    measured = {}
    read_shards = module.read_shards

    def measured_read(model, targets, device, on_progress):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := VmRSS
        before = _status("VmRSS")
        read_shards(model, targets, device, on_progress)
        measured["added"] = _status("VmHWM") - before

    module.read_shards = measured_read
    try:
        loaded = module.load_sharded(stand_in_config(path, decode="reshard"), device="cpu")
    finally:
        module.read_shards = read_shards
    largest = max(p.numel() for p in loaded.model.parameters())  # global elements of the largest tensor
    return {**measured, "shard": local_param_bytes(loaded.model), "largest": largest}


def test_a_load_holds_its_dequantized_shard_plus_one_slice(ranks, tmp_path):
    """Each rank's read of FP8 blocks adds its float32 shard, the codes it touched (a byte a value) and about one
    slice of a tensor: never a whole tensor's float32 copies (here 16 MiB each, against 8 MiB slices)."""
    source = make_tiny_lm(
        tmp_path / "float32", family="llama", num_layers=1, hidden_size=256, intermediate_size=16384, num_heads=4
    )
    path, _ = write_quantized(source, tmp_path / "fp8", "fp8-blocks")
    for rank, result in enumerate(ranks(peak_memory_of_the_read, path)):
        shard_elements = result["shard"] // 4
        slice_bytes = result["largest"] * 4 // 2
        allowed = result["shard"] + shard_elements + slice_bytes + 16 * 2**20
        assert result["added"] <= allowed, (rank, result, allowed)
        assert result["added"] >= result["shard"] // 2, (rank, result)  # the measurement saw the shard arrive


def load_shipped_fp8_config(rank: int, path: Path) -> dict:
    """configs/glm-744b-fp8-npu.yaml as shipped, with only the checkpoint, ranks, device and dtype overridden."""
    from shardbook.rankd.config.parsing import load_config
    from shardbook.rankd.loading.load_sharded import load_sharded
    from tests.multiproc.test_mla import CONFIGS

    overrides = [
        *("--model.model_name_or_path", str(path), "--model.dtype", "float32"),
        *("--parallel.fsdp_size", "2", "--parallel.ep_size", "2", "--parallel.ep_fsdp_size", "1"),
        *("--parallel.device", "cpu"),
    ]
    loaded = load_sharded(load_config(CONFIGS / "glm-744b-fp8-npu.yaml", overrides, world_size=2), device="cpu")
    with torch.no_grad():
        return {"summary": loaded.summary, "logits": loaded.model(prompt_ids(loaded.tokenizer)).logits}


def test_the_shipped_fp8_config_loads_a_tiny_glm5_fp8_under_tp(ranks, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from shardbook.rankd.config.parsing import load_config
    from tests.multiproc.test_mla import CONFIGS

    shipped = load_config(CONFIGS / "glm-744b-fp8-npu.yaml", world_size=32)
    assert (shipped.parallel.decode, shipped.model.dtype, shipped.parallel.device) == ("tp", "bfloat16", "npu")
    path, twin = write_quantized(
        make_tiny_mla(tmp_path / "float32", "glm_moe_dsa"), tmp_path / "glm5-fp8", "fp8-blocks"
    )
    model = AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).eval()
    with torch.no_grad():
        reference = model(prompt_ids(AutoTokenizer.from_pretrained(twin))).logits
    for rank, result in enumerate(ranks(load_shipped_fp8_config, path)):
        summary = result["summary"]
        assert summary["architecture"] == "GlmMoeDsaForCausalLM" and summary["decode"] == "tp"
        assert list(summary["quantized_tensors"]) == ["fp8 e4m3, 32x32 blocks"]
        close(result["logits"], reference, f"rank {rank}")
