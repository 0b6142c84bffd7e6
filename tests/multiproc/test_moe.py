"""Mixture-of-experts checkpoints on gloo ranks: one process's logits in every layout,
experts held once between the ranks.

The tiny checkpoints are written by `save_pretrained`, which stores every expert apart as the Hub
does, so each load goes through transformers' conversion mapping.
"""

from __future__ import annotations

import json
import re

import pytest
import torch

from shardbook.rankd.generation.cache_keyword import cache_keyword
from tests.multiproc.test_loading import prompt_ids
from tests.tiny import make_tiny_moe

EP_FAMILIES = ["qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe"]
LAYOUTS = {
    "ep1-plain": ({}, 2),  # auto: FSDP2 keeping the gathered layers, experts sharded like every other weight
    "ep2": ({"ep_size": 2}, 2),
    "ep2-efsdp2": ({"ep_size": 2, "ep_fsdp_size": 2}, 4),
}


def load_and_forward(rank: int, path, parallel: dict) -> dict:
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded
    from shardbook.rankd.parallel.layout import reshard_model

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
    )
    loaded = load_sharded(config, device="cpu")
    # the gather layout keeps FSDP2's gathered weights after a forward (the load's warm-up is one): count the shards
    reshard_model(loaded.model)
    experts = [p for name, p in loaded.model.named_parameters() if ".experts." in name]
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() for p in experts)
    total = sum(_global(p) for p in experts)
    with torch.no_grad():
        logits = loaded.model(prompt_ids(loaded.tokenizer)).logits
    whole = whole_experts(loaded.model) if parallel else None
    return {"logits": logits, "summary": loaded.summary, "expert_numel": local, "expert_total": total, "whole": whole}


def whole_experts(model) -> torch.Tensor | None:
    """Layer 1's fused gate_up experts joined on rank 0 from every rank's experts and rows (None elsewhere)."""
    from shardbook.rankd.parallel.wholes import full_parameter_on_rank0

    return full_parameter_on_rank0(model, model.model.layers[1].mlp.experts.gate_up_proj)


def _global(param) -> int:
    from shardbook.rankd.parallel.tp_modules import global_numel

    return global_numel(param)


def one_process(path) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's logits and layer 1's fused gate_up experts, as transformers loads them in one process."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(prompt_ids(AutoTokenizer.from_pretrained(path))).logits
    return logits, model.model.layers[1].mlp.experts.gate_up_proj.detach().clone()


@pytest.fixture(scope="module")
def families(tmp_path_factory) -> dict:
    """Each family's tiny checkpoint and its one-process logits."""
    paths = {family: make_tiny_moe(tmp_path_factory.mktemp(family) / "model", family) for family in EP_FAMILIES}
    return {family: (path, *one_process(path)) for family, path in paths.items()}


def load_each(rank: int, paths: dict, parallel: dict) -> dict:
    """Every family in turn on the same ranks (one process group: spawning costs more than these loads)."""
    return {family: load_and_forward(rank, path, parallel) for family, path in paths.items()}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_moe_logits_match_one_process(ranks, families, layout):
    parallel, world_size = LAYOUTS[layout]
    paths = {family: path for family, (path, _, _) in families.items()}
    per_rank = ranks(load_each, paths, parallel, world_size=world_size, deadline=240)
    for family, (_, reference, gate_up) in families.items():
        if parallel:  # full_parameter joins every rank's experts and rows into transformers' own fused tensor
            torch.testing.assert_close(per_rank[0][family]["whole"], gate_up, atol=0, rtol=0, msg=family)
        for rank, results in enumerate(per_rank):
            result = results[family]
            assert not torch.isnan(result["logits"]).any(), f"{family} rank {rank}: NaN in the logits"
            torch.testing.assert_close(result["logits"], reference, atol=1e-4, rtol=0, msg=f"{family} rank {rank}")
            # every rank holds 1/(ep x ep_fsdp) of the experts (1/2 under FSDP2, which shards them over both ranks)
            assert result["expert_numel"] * world_size == result["expert_total"], (family, rank, result["expert_numel"])
        summary = per_rank[0][family]["summary"]
        if parallel:
            assert summary["decode"] == "tp" and "expert parallelism runs in the tp layout" in summary["decode_reason"]
            ep, efsdp = parallel["ep_size"], parallel.get("ep_fsdp_size", 1)
            assert f"mesh (edp=1, efsdp={efsdp}, ep={ep})" in summary["decode_reason"], family
        else:
            assert summary["decode"] == "gather", family


def test_deepseek_v3_loads_sharded_in_the_fsdp_layouts_and_tp_says_what_it_needs(ranks, tmp_path):
    """DeepSeek-V3 (multi-head latent attention): its experts load from per-expert tensors; tp (test_mla) needs one
    key per query head, and this config's 2 key/value heads for 4 query heads are refused clearly."""
    path = make_tiny_moe(tmp_path / "deepseek", "deepseek_v3")
    reference, _ = one_process(path)
    for result in ranks(load_and_forward, path, {"decode": "reshard"}):
        torch.testing.assert_close(result["logits"], reference, atol=1e-4, rtol=0)
    for message in ranks(failing_load, path, {"ep_size": 2}):
        assert "tp needs num_key_value_heads = num_attention_heads" in message and "gather" in message


def failing_load(rank: int, path, parallel: dict) -> str:
    try:
        load_and_forward(rank, path, parallel)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_bad_expert_layouts_name_the_rule(ranks, tmp_path):
    path = make_tiny_moe(tmp_path / "qwen3", "qwen3_moe")
    messages = ranks(failing_load, path, {"ep_size": 16, "decode": "tp"})
    assert all("does not divide the 2 ranks" in m for m in messages), messages
    one_expert = make_tiny_moe(tmp_path / "one-expert", "qwen3_moe", num_experts=1, num_experts_per_tok=1)
    messages = ranks(failing_load, one_expert, {"ep_size": 2})  # more expert groups than experts
    assert all("ep_size=2 does not divide the model's 1 experts" in m for m in messages), messages
    dense = tmp_path / "dense"
    from tests.tiny import make_tiny_llama

    make_tiny_llama(dense)
    messages = ranks(failing_load, dense, {"ep_size": 2})
    assert all("apply to mixture-of-experts models" in m and "set both to 1" in m for m in messages), messages


def test_a_missing_expert_tensor_is_named(tmp_path):
    """One expert's down_proj missing: the error names it, not a stack of the wrong shape."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardbook.rankd.loading.weight_reading import plan_reads

    path = make_tiny_moe(tmp_path / "qwen3", "qwen3_moe")
    missing = "model.layers.1.mlp.experts.3.down_proj.weight"
    for file in path.glob("*.safetensors"):
        tensors = load_file(file)
        if missing in tensors:
            del tensors[missing]
            save_file(tensors, file, metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.exists():
        data = json.loads(index.read_text())
        del data["weight_map"][missing]
        index.write_text(json.dumps(data))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    with pytest.raises(ValueError, match=re.escape(missing)) as error:
        plan_reads(model, path)
    assert "shape" not in str(error.value)


SYNC_OPS = ("aten::nonzero", "aten::item", "aten::_local_scalar_dense")
"""The ops that wait for the device (the host needs a value computed there), as torch.profiler names them on CPU."""


def count_syncs(model, step) -> tuple[int, int]:
    """(host syncs inside the experts' forwards, MoE layers run) during ``step()``, from torch.profiler's events."""
    from torch.profiler import ProfilerActivity, profile, record_function

    experts = [m for name, m in model.named_modules() if name.endswith("mlp.experts")]
    handles = []
    for module in experts:

        def enter(mod, args, kwargs=None):
            mod._sync_probe = record_function("shardbook::experts")
            mod._sync_probe.__enter__()

        def leave(mod, args, output):
            mod._sync_probe.__exit__(None, None, None)

        handles += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
    finally:
        for handle in handles:
            handle.remove()
    inside, layers = 0, 0
    for event in prof.events():
        if event.name == "shardbook::experts":
            layers += 1
        if event.name in SYNC_OPS:
            parent = event.cpu_parent
            while parent is not None and parent.name != "shardbook::experts":
                parent = parent.cpu_parent
            inside += parent is not None
    return inside, layers


def decode_step_syncs(rank: int, path, parallel: dict) -> tuple[int, int]:
    from transformers import DynamicCache

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
    )
    model = load_sharded(config, device="cpu").model
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])
    cache = {cache_keyword(model): DynamicCache(config=model.config)}
    with torch.no_grad():
        model(input_ids=ids, **cache, use_cache=True)  # the prompt; then one decode step, profiled
        return count_syncs(model, lambda: model(input_ids=ids[:, -1:], **cache, use_cache=True))


def test_experts_sync_with_the_host_once_per_layer(ranks, tmp_path):
    """A decode step under expert parallelism: at most one host sync per MoE layer inside the experts' forward
    (before: a ``torch.where`` per local expert per layer, whether it received tokens or not)."""
    path = make_tiny_moe(tmp_path / "model", "qwen3_moe")
    for inside, layers in ranks(decode_step_syncs, path, {"ep_size": 2}):
        assert layers > 0 and inside <= layers, (inside, layers)


def count_all_reduces(model, step) -> list[int]:
    """All-reduces run inside each MoE block (a layer's `mlp` holding experts) during ``step()``, per block: over
    the backend or through shared memory (`HostSum`), whichever the group uses."""
    import torch.distributed as dist

    from shardbook.rankd.parallel.host_sum import HostSum

    blocks = [m for name, m in model.named_modules() if name.endswith(".mlp") and hasattr(m, "experts")]
    counts, real, real_host_sum = [], dist.all_reduce, HostSum.sum_

    def counted(fn):
        def counting(*args, **kwargs):
            if inside[0]:
                counts[-1] += 1
            return fn(*args, **kwargs)

        return counting

    def enter(module, args):
        counts.append(0)
        inside[0] = 1

    def leave(module, args, output):
        inside[0] = 0

    inside, handles = [0], []
    for block in blocks:  # hooks on the block itself see its summed output, so they leave its one sum in place
        handles += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
    dist.all_reduce, HostSum.sum_ = counted(real), counted(real_host_sum)
    try:
        step()
    finally:
        dist.all_reduce, HostSum.sum_ = real, real_host_sum
        for handle in handles:
            handle.remove()
    return counts


def decode_step_all_reduces(rank: int, path, parallel: dict) -> dict:
    """All-reduces per MoE block in one decode step, and the step's logits."""
    from transformers import DynamicCache

    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(**parallel)
    )
    model = load_sharded(config, device="cpu").model
    ids = torch.tensor([[1, 2, 3, 4, 5, 6]])

    def step() -> tuple[list[int], torch.Tensor]:
        cache, out = {cache_keyword(model): DynamicCache(config=model.config)}, []
        model(input_ids=ids[:, :-1], **cache, use_cache=True)
        counts = count_all_reduces(model, lambda: out.append(model(input_ids=ids[:, -1:], **cache)))
        return counts, out[0].logits

    with torch.no_grad():
        counts, logits = step()
        shared = [m for name, m in model.named_modules() if name.endswith(("shared_expert", "shared_experts"))]
        handle = shared[0].register_forward_hook(lambda m, a, output: None)  # a watched block sums as before
        try:
            watched_counts, watched_logits = step()
        finally:
            handle.remove()
    return {"counts": counts, "logits": logits, "watched": watched_counts, "watched_logits": watched_logits}


def one_process_decode_step(path) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6]])).logits[:, -1:]


@pytest.mark.parametrize("family", ["qwen2_moe", "glm4_moe"])
def test_shared_experts_join_the_experts_one_all_reduce(ranks, tmp_path, family):
    """Issue 17 item 21: under tp a MoE block with shared experts makes one all-reduce per decode step (before:
    two, the shared experts' down_proj summing on its own), and the logits are still one process's."""
    path = make_tiny_moe(tmp_path / "model", family)
    reference = one_process_decode_step(path)
    for rank, result in enumerate(ranks(decode_step_all_reduces, path, {"ep_size": 2})):
        assert result["counts"] and set(result["counts"]) == {1}, (family, rank, result["counts"])
        assert result["watched"][0] == 2 and set(result["watched"][1:]) <= {1}, (family, rank, result["watched"])
        for logits in (result["logits"], result["watched_logits"]):
            torch.testing.assert_close(logits, reference, atol=1e-4, rtol=0, msg=f"{family} rank {rank}")


def test_unexpected_expert_weight_layouts_are_refused():
    """transformers' per-family flags (transposed, interleaved, bias, ...) that the expert-parallel forward does not
    handle fail clearly instead of computing something else."""
    from torch import nn

    from shardbook.rankd.parallel.expert_parallel import expert_weights_problem

    experts = nn.Module()
    assert expert_weights_problem(experts) is None  # no flags: the layout every family had before transformers 5
    experts.is_transposed, experts.has_bias, experts.has_gate = False, False, True
    assert expert_weights_problem(experts) is None
    experts.is_transposed, experts.has_bias = True, True
    problem = expert_weights_problem(experts)
    assert "is_transposed=True" in problem and "has_bias=True" in problem and "parallel.ep_size 1" in problem
