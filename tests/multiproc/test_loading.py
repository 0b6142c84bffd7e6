"""Sharded loading on 2 gloo ranks: the logits and tokens of one process, the expected layout, errors on every rank."""

from __future__ import annotations

import gc
import json
import os
import types
import weakref
from pathlib import Path

import platformdirs
import pytest
import torch

from tests.tiny import cache_bytes_per_token, make_tiny_llama, make_tiny_non_causal

PROMPT = "What is the capital of France?"
NUM_TOKENS = 20
STEPS = ["config", "skeleton", "shard", "read", "finalise", "warm-up"]  # warm-up: under gather only


def stand_in_config(path, *, fsdp_size=-1, dtype="float32", decode="auto", ep_size=1):
    """A duck-typed config with the attributes `load_sharded` reads (no validation of its own)."""
    return types.SimpleNamespace(
        model=types.SimpleNamespace(model_name_or_path=str(path), dtype=dtype, trust_remote_code=False),
        parallel=types.SimpleNamespace(fsdp_size=fsdp_size, ep_size=ep_size, ep_fsdp_size=1, decode=decode),
    )


def prompt_ids(tokenizer) -> torch.Tensor:
    messages = [{"role": "user", "content": PROMPT}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, return_tensors="pt")["input_ids"]


def run_model(model, tokenizer, *, synced: bool) -> dict:
    """Prompt logits and NUM_TOKENS greedy tokens (synced_gpus keeps sharded ranks stepping together)."""
    ids = prompt_ids(tokenizer)
    with torch.no_grad():
        logits = model(ids).logits.float()
        out = model.generate(
            ids, max_new_tokens=NUM_TOKENS, min_new_tokens=NUM_TOKENS, do_sample=False, synced_gpus=synced
        )
    new = out[0, ids.shape[1] :]
    return {"logits": logits, "tokens": new.tolist(), "text": tokenizer.decode(new)}


def single_process(path: Path, dtype=torch.float32) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    return run_model(model, AutoTokenizer.from_pretrained(path), synced=False)


def layout(model) -> dict:
    """Per parameter: DTensor or not, placements, local and global shapes; plus tying and rotary buffers."""
    from torch.distributed.tensor import DTensor

    params = {}
    for name, p in model.named_parameters():
        is_dtensor = isinstance(p, DTensor)
        local = p.to_local() if is_dtensor else p
        params[name] = (is_dtensor, [repr(pl) for pl in getattr(p, "placements", ())], list(local.shape), list(p.shape))
    rotary = model.model.rotary_emb
    return {
        "params": params,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
        "inv_freq": rotary.inv_freq.clone(),
        "inv_freq_expected": rotary.compute_default_rope_parameters(model.config)[0],
    }


def load_and_run(rank, path, parallel: dict, dtype: str = "float32") -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype=dtype), parallel=ParallelConfig(**parallel)
    )
    steps = []
    from torch.distributed.tensor import DTensor

    from shardbook.rankd.parallel.layout import reshard_model

    loaded = load_sharded(config, device="cpu", progress=lambda step, done, total: steps.append((step, done, total)))
    # under gather the load's warm-up forward leaves the gathered weights registered: plain tensors, whole
    gathered = {name: not isinstance(p, DTensor) for name, p in loaded.model.named_parameters()}
    reshard_model(loaded.model)  # back to the shards, to see the layout
    sharded = layout(loaded.model)
    mapped = mapped_params(loaded.model, Path(path))
    outputs = run_model(loaded.model, loaded.tokenizer, synced=True)
    return {**outputs, **sharded, "mapped": mapped, "steps": steps, "summary": loaded.summary, "gathered": gathered}


def mapped_params(model, path: Path) -> dict[str, bool]:
    """Per parameter: is this rank's shard a view of a mapped checkpoint file (its storage is the whole file)?"""
    file_sizes = {file.stat().st_size for file in path.glob("*.safetensors")}
    return {name: p.to_local().untyped_storage().nbytes() in file_sizes for name, p in model.named_parameters()}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny"))


@pytest.fixture(scope="module")
def tiny_reference(tiny) -> dict:
    return single_process(tiny)


def tiny_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def assert_same_as_reference(results: list[dict], reference: dict) -> None:
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], reference["logits"], atol=1e-5, rtol=0, msg=f"rank {rank}")
        assert result["tokens"] == reference["tokens"], f"rank {rank}"


def test_fsdp_matches_single_process(ranks, tiny, tiny_reference):
    results = ranks(load_and_run, tiny, {"fsdp_size": -1})
    assert_same_as_reference(results, tiny_reference)
    for rank, result in enumerate(results):
        for name, (is_dtensor, placements, local, full) in result["params"].items():
            assert is_dtensor and placements == ["Shard(dim=0)"], name
            first_half = -(-full[0] // 2)
            assert local == [[first_half, full[0] - first_half][rank], *full[1:]], (rank, name, local, full)
            # On CPU a shard is the mapped file itself, unless FSDP2 had to pad it (rank 1 of an odd row count).
            assert result["mapped"][name] == (local[0] == first_half), (rank, name, local, full)
        assert result["tied"]
        torch.testing.assert_close(result["inv_freq"], result["inv_freq_expected"], atol=0, rtol=0)
        assert STEPS == list(dict.fromkeys(step for step, _, _ in result["steps"]))
        assert [done for step, done, _ in result["steps"] if step == "shard"] == [1, 2, 3]  # 2 layers, then the root
        summary = result["summary"]
        assert summary["architecture"] == "LlamaForCausalLM"
        assert summary["mesh_shape"] == [2] and summary["mesh_axes"] == ["shard"]
        assert sum(summary["local_param_bytes"]) == summary["full_param_bytes"]
        assert summary["decode"] == "gather" and "fits" in summary["decode_reason"]
        # the first forward's all-gather of every layer happened inside the load, not in the first reply
        assert all(result["gathered"].values()) and summary["warm_up_s"] > 0, result["gathered"]
        # the batch's KV cache budget: what a real cache holds per token, against half of the free memory
        assert summary["kv_cache_bytes_per_token"] == [cache_bytes_per_token(tiny_model(tiny))]
        assert summary["kv_cache_tokens"] > 10_000 and "50% of rank" in summary["kv_cache_tokens_reason"]


def test_world_of_one_rank(ranks, tiny, tiny_reference):
    """A plain kernel (no torchrun) is a one-rank world: the same code path loads the whole model."""
    (result,) = ranks(load_and_run, tiny, {"fsdp_size": -1}, world_size=1)
    assert_same_as_reference([result], tiny_reference)
    assert result["summary"]["mesh_shape"] == [1]
    assert result["summary"]["local_param_bytes"] == [result["summary"]["full_param_bytes"]]


def test_multi_file_untied_checkpoint(ranks, tmp_path):
    path = make_tiny_llama(tmp_path / "untied", tie_word_embeddings=False, max_shard_size="40KB", seed=1)
    assert len(list(path.glob("*.safetensors"))) > 2
    results = ranks(load_and_run, path, {"fsdp_size": -1, "reshard_after_forward": True})
    assert_same_as_reference(results, single_process(path))
    for result in results:
        assert not result["tied"]
        assert result["summary"]["decode"] == "reshard"  # MindSpeed's flag names the layout
        assert result["summary"]["decode_reason"] == "set by parallel.decode"


def test_hsdp_replicate_two_by_shard_one(ranks, tiny, tiny_reference):
    results = ranks(load_and_run, tiny, {"fsdp_size": 1})
    assert_same_as_reference(results, tiny_reference)
    for result in results:
        assert result["summary"]["mesh_shape"] == [2, 1]
        assert result["summary"]["mesh_axes"] == ["replicate", "shard"]
        for name, (is_dtensor, placements, local, full) in result["params"].items():
            assert is_dtensor and placements == ["Replicate()", "Shard(dim=0)"] and local == full, name
            assert result["mapped"][name], name
        assert result["tied"]


@pytest.fixture(scope="module")
def tiny_bf16(tiny, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = tmp_path_factory.mktemp("bf16")
    AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.bfloat16).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny).save_pretrained(path)
    return path


@pytest.mark.parametrize(
    ("requested", "dtype"),
    [("auto", torch.bfloat16), ("float32", torch.float32), ("float16", torch.float16)],
    ids=["auto", "float32", "float16"],
)
def test_dtype_of_a_bfloat16_checkpoint(ranks, tiny_bf16, requested, dtype):
    results = ranks(load_and_run, tiny_bf16, {"fsdp_size": -1}, requested)
    reference = single_process(tiny_bf16, dtype=dtype)
    for result in results:
        assert result["summary"]["dtype"] == str(dtype).removeprefix("torch.")
        assert result["inv_freq"].dtype == torch.float32
        torch.testing.assert_close(result["logits"], reference["logits"], atol=0, rtol=0)
        assert result["tokens"] == reference["tokens"]
    # Shards in the file's own dtype may be views of it; converted ones are copies.
    assert any(results[0]["mapped"].values()) == (requested == "auto")


def failing_loads(rank, paths: dict) -> dict:
    """Each bad request on both ranks; the messages each rank raised, and whether the group still works."""
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.loading.safetensors_files import MappedFiles

    tiny = paths["tiny"]
    cases = {
        "missing path": (stand_in_config(paths["missing"]), None),
        "not a causal LM": (stand_in_config(paths["bert"]), None),
        "fsdp_size does not divide": (stand_in_config(tiny, fsdp_size=3), None),
        "expert parallel": (stand_in_config(tiny, ep_size=2), None),
        "unsupported dtype": (stand_in_config(tiny, dtype="float64"), None),
        "tensor missing from files": (stand_in_config(paths["incomplete"]), None),
        "path missing on rank 1 only": (stand_in_config(tiny), paths["missing"] if rank == 1 else None),
        "file truncated on rank 1 only": (stand_in_config(tiny), paths["truncated"] if rank == 1 else None),
        "config does not match weights": (stand_in_config(paths["mismatched"]), None),
    }
    messages = {}
    for case, (config, model_path) in cases.items():
        messages[case] = _message_of(lambda c=config, p=model_path: load_sharded(c, device="cpu", model_path=p))

    real_view = MappedFiles.view

    def broken_view(self, stored):
        raise OSError("simulated read failure")

    if rank == 1:
        MappedFiles.view = broken_view
    try:
        kept = None
        try:
            load_sharded(stand_in_config(tiny), device="cpu")
        except ValueError as e:
            kept = e  # as a notebook keeps the last error (sys.last_value)
        messages["read fails on rank 1 only"] = f"{type(kept).__name__}: {kept}"
    finally:
        MappedFiles.view = real_view
    gc.collect()
    pinned = sum(
        isinstance(o, torch.nn.Module) and type(o).__name__.endswith("LlamaForCausalLM") for o in gc.get_objects()
    )
    del kept
    healthy = load_sharded(stand_in_config(tiny), device="cpu")
    then = run_model(healthy.model, healthy.tokenizer, synced=True)
    return {"messages": messages, "models_pinned_by_error": pinned, "then": then}


def _message_of(fn) -> str:
    try:
        fn()
    except ValueError as e:
        return f"ValueError: {e}"
    return "loaded"


@pytest.fixture(scope="module")
def failures(ranks, tiny, tmp_path_factory) -> list[dict]:
    from safetensors.torch import load_file, save_file

    root = tmp_path_factory.mktemp("bad")
    incomplete = make_tiny_llama(root / "incomplete")
    weights = load_file(incomplete / "model.safetensors")
    del weights["model.norm.weight"]
    save_file(weights, incomplete / "model.safetensors", metadata={"format": "pt"})
    bert = make_tiny_non_causal(root / "bert")
    truncated = make_tiny_llama(root / "truncated")
    with open(truncated / "model.safetensors", "r+b") as f:
        f.truncate(f.seek(0, os.SEEK_END) - 1000)
    mismatched = make_tiny_llama(root / "mismatched")
    config = json.loads((mismatched / "config.json").read_text())
    (mismatched / "config.json").write_text(
        json.dumps({**config, "intermediate_size": config["intermediate_size"] * 2})
    )
    paths = {
        "tiny": tiny,
        "missing": root / "nowhere",
        "bert": bert,
        "incomplete": incomplete,
        "truncated": truncated,
        "mismatched": mismatched,
    }
    return ranks(failing_loads, paths, deadline=120)


EXPECTED = {
    "missing path": ["nowhere is not a checkpoint directory", "demo name"],
    "not a causal LM": ["BertModel, not a causal language model", "LlamaForCausalLM"],
    "fsdp_size does not divide": ["fsdp_size=3 does not divide the world size 2", "use -1"],
    "expert parallel": ["ep_size=2", "llama has no experts: set both to 1"],
    "unsupported dtype": ["'float64' is not supported", "float32, bfloat16, float16"],
    "tensor missing from files": ["lacks 1 tensor(s)", "model.norm.weight"],
    "config does not match weights": ["expects [", "the config and the weights do not match"],
}


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_request_raises_on_every_rank(failures, case):
    for rank, result in enumerate(failures):
        message = result["messages"][case]
        assert message.startswith("ValueError"), (rank, message)
        for part in EXPECTED[case]:
            assert part in message, (rank, message)


def test_path_missing_on_one_rank_stops_every_rank(failures):
    rank0, rank1 = (result["messages"]["path missing on rank 1 only"] for result in failures)
    assert "loading stopped because rank(s) [1] could not read the checkpoint's config" in rank0
    assert rank1.startswith("ValueError: ") and "nowhere is not a checkpoint directory" in rank1


def test_truncated_file_on_one_rank_stops_every_rank_before_any_read(failures):
    """A mapped page past the end of a file would kill the rank (SIGBUS): the headers are checked first."""
    rank0, rank1 = (result["messages"]["file truncated on rank 1 only"] for result in failures)
    assert "loading stopped because rank(s) [1] could not match the checkpoint's tensors" in rank0
    assert "is not a complete safetensors file" in rank1 and "(truncated)" in rank1, rank1
    assert "copy or download the checkpoint again" in rank1


def test_read_failure_on_one_rank_stops_every_rank(failures):
    rank0, rank1 = (result["messages"]["read fails on rank 1 only"] for result in failures)
    assert "loading stopped because rank(s) [1] could not read its slices" in rank0
    assert "simulated read failure" in rank0
    assert rank1.startswith("ValueError: could not read its slices") and "OSError: simulated read failure" in rank1


def test_failed_load_frees_its_model_and_the_group_still_works(failures, tiny_reference):
    for result in failures:
        assert result["models_pinned_by_error"] == 0
    assert_same_as_reference([result["then"] for result in failures], tiny_reference)


def interrupted_loads(rank, path) -> dict:
    """The stop event set on one rank only, before the load and midway through sharding; then a load that works."""
    import threading

    from shardbook.rankd.loading.load_sharded import load_sharded

    outcomes = {}
    for case, stopped_rank, at_step in (("before", 0, None), ("while sharding", 1, "shard")):
        stop = threading.Event()
        if rank == stopped_rank and at_step is None:
            stop.set()

        def progress(step, done, total, stop=stop, at_step=at_step, stopped_rank=stopped_rank):
            if rank == stopped_rank and step == at_step and done == 1:
                stop.set()  # as the interrupt message reaching this rank first

        try:
            load_sharded(stand_in_config(path), device="cpu", progress=progress, stop=stop)
            outcomes[case] = "loaded"
        except KeyboardInterrupt as e:
            outcomes[case] = f"KeyboardInterrupt: {e}"
    healthy = load_sharded(stand_in_config(path), device="cpu")
    return {"outcomes": outcomes, "then": run_model(healthy.model, healthy.tokenizer, synced=True)}


def test_interrupt_on_one_rank_stops_every_rank_at_a_safe_point(ranks, tiny, tiny_reference):
    results = ranks(interrupted_loads, tiny, deadline=120)
    for result in results:
        for case, outcome in result["outcomes"].items():
            assert outcome.startswith("KeyboardInterrupt: the load was interrupted"), (case, outcome)
            assert "the new model is not loaded; load it again" in outcome
    assert_same_as_reference([result["then"] for result in results], tiny_reference)


def reload_and_free(rank, path) -> dict:
    from torch.distributed.tensor import DTensor

    from shardbook.rankd.loading.load_sharded import free_model, load_sharded

    def broken_progress(step, done, total):
        if rank == 0 and step == "shard":
            raise RuntimeError("widget gone")

    first = load_sharded(stand_in_config(path), device="cpu", progress=broken_progress)
    namespace = {"model": first.model, "tokenizer": first.tokenizer}
    run_model(first.model, first.tokenizer, synced=True)  # leaves the gathered weights registered
    old = weakref.ref(first.model)
    lingering = first.model.lm_head  # as IPython's Out might hold a piece of it
    del first
    free_model(namespace, device="cpu")
    resharded = isinstance(lingering.weight, DTensor)
    del lingering
    free_model({}, device="cpu")
    second = load_sharded(stand_in_config(path), device="cpu")
    return {
        "freed": old() is None,
        "resharded": resharded,
        "namespace": sorted(namespace),
        **run_model(second.model, second.tokenizer, synced=True),
    }


def test_reload_frees_the_previous_model_and_survives_a_broken_progress_callback(ranks, tiny, tiny_reference):
    results = ranks(reload_and_free, tiny)
    for result in results:
        assert result["resharded"] and result["freed"] and result["namespace"] == []
    assert_same_as_reference(results, tiny_reference)


def demo_model_dir() -> Path:
    home = Path(os.environ.get("SHARDBOOK_HOME") or platformdirs.user_cache_dir("shardbook"))
    return home / "models" / "smollm2-135m-instruct"


@pytest.mark.slow
def test_demo_model_answers_paris_like_one_process(ranks):
    path = demo_model_dir()
    if not (path / "config.json").is_file():
        pytest.skip(f"demo model not built at {path} (run `shardbook fetch smollm2-135m-instruct`)")
    results = ranks(load_and_run, path, {"fsdp_size": -1}, deadline=240)
    reference = single_process(path)
    for result in results:
        assert result["tokens"] == reference["tokens"]
        assert "Paris" in result["text"], result["text"]
