"""%load_sharded, %shards and bad input, through a real 2-rank kernel on a tiny local model."""

from __future__ import annotations

import contextlib
import re

import pytest

from shardbook.rankd.parallel.packed_linear import packing_available
from tests.driver import interrupt_when
from tests.quantized import write_quantized
from tests.tiny import make_broken_checkpoints, make_tiny_llama, make_tiny_moe, make_tiny_non_causal

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


def load(kernel, target, *overrides, timeout=120):
    return kernel.run(f"%load_sharded --model.model_name_or_path {target} {' '.join(overrides)}", timeout=timeout)


def assert_usable(kernel):
    """No rank left busy or inside a collective: a cell with a collective still works on both."""
    ex = kernel.run(
        "%%all\nimport torch, torch.distributed as dist\nt = torch.ones(1)\ndist.all_reduce(t)\nprint('ok', t.item())"
    )
    assert ex.status == "ok" and ex.stdout().count("ok 2.0") == 2, ex.error_text() + ex.stderr()


def test_load_summary_progress_and_namespaces(kernel, tiny):
    ex = load(kernel, tiny)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "LlamaForCausalLM" in summary and "shard=2 (2 ranks)" in summary and "decode" in summary
    assert "gather — the gathered model" in summary and "fits in half of the memory free per rank" in summary
    assert "rank 1" in summary and "local params" in summary
    opened = [
        m for m in ex.of_type("comm_open") if m["content"]["data"]["state"].get("_model_name") == "IntProgressModel"
    ]
    assert opened, "no progress bar widget"
    updates = [m for m in ex.of_type("comm_msg") if m["content"]["comm_id"] == opened[0]["content"]["comm_id"]]
    values = [
        m["content"]["data"]["state"]["value"] for m in updates if "value" in m["content"]["data"].get("state", {})
    ]
    assert len(values) >= 3 and values[-1] == 100 and values == sorted(values)
    ex = kernel.run("%%all\nw = model.model.embed_tokens.weight\nprint(type(w).__name__, tuple(w.shape))")
    assert ex.status == "ok", ex.error_text()
    for rank in (0, 1):  # under gather the load ends with a warm-up forward: the weights are gathered already
        assert f"[rank {rank}]\nParameter (384, 64)\n" in ex.stdout(), ex.stdout()
    assert kernel.run("%shards").status == "ok"  # puts every rank back to its shards first
    ex = kernel.run(
        "%%all\nimport torch.distributed as dist\nw = model.model.embed_tokens.weight\n"
        "print(dist.get_rank(), type(tokenizer).__name__, tuple(w.to_local().shape), tuple(w.shape))"
    )
    assert ex.status == "ok", ex.error_text()
    out = ex.stdout()
    for rank in (0, 1):  # the tiny vocabulary of 384 rows is split in half, rows 0-191 and 192-383
        assert f"[rank {rank}]\n{rank} TokenizersBackend (192, 64) (384, 64)\n" in out, out


def test_a_model_directory_is_enough_and_overrides_apply(kernel, tiny):
    ex = kernel.run(f"%load_sharded {tiny} --parallel.decode tp", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert f"no config file (model directory {tiny}, defaults for every setting)" in summary, summary
    assert "tp — " in summary and "LlamaForCausalLM" in summary


def test_shards_table(kernel, tiny):
    assert load(kernel, tiny).status == "ok"
    ex = kernel.run("%shards model.layers.0.self_attn.q_proj")
    table = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    row = [line for line in table.splitlines() if line.startswith("model.layers.0.self_attn.q_proj.weight")][0]
    assert row.split() == [
        "model.layers.0.self_attn.q_proj.weight",
        "[64,",
        "64]",
        "float32",
        "S(0)",
        "[32,",
        "64]",
        "[32,",
        "64]",
    ]
    locals_ = kernel.run("%%all\nprint(tuple(model.model.layers[0].self_attn.q_proj.weight.to_local().shape))").stdout()
    assert locals_.count("(32, 64)") == 2
    missing = kernel.run("%shards nothing.here")
    assert missing.status == "error" and "no parameter name starts with 'nothing.here'" in missing.stderr()


def test_shards_of_an_fp8_checkpoint_list_dequantized_weights(kernel, tmp_path):
    """FP8 block weights are held dequantized: `%shards` lists them in `model.dtype`, sliced by `tp` as any weight
    (5 heads split 3 and 2, inside the checkpoint's 32 x 32 blocks), and no scale tensor among the parameters."""
    source = make_tiny_llama(tmp_path / "float32", hidden_size=80, num_heads=5, num_kv_heads=1)
    fp8, _ = write_quantized(source, tmp_path / "fp8", "fp8-blocks")
    ex = load(kernel, fp8, "--parallel.decode tp", "--model.dtype bfloat16")
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "in fp8 e4m3, 32x32 blocks, dequantized to bfloat16" in summary, summary
    table = kernel.run("%shards").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    rows = {cells[0]: cells for cells in (re.split(r"\s{2,}", line) for line in table.splitlines()[2:])}
    assert "model.layers.0.self_attn.q_proj.weight" in rows and not [name for name in rows if "scale" in name], table
    assert {cells[2] for cells in rows.values()} == {"bfloat16"}, table  # codes would show float8_e4m3fn
    assert rows["model.layers.0.self_attn.q_proj.weight"][1:] == [
        "[80, 80]",
        "bfloat16",
        "tp: rows (dim 0) over 2 rank(s), uneven",
        "[48, 80]",
        "[32, 80]",
    ], table


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """The demo model's head layout, 9 query heads over 3 KV heads, that no even split serves on 2 ranks."""
    return make_tiny_llama(tmp_path_factory.mktemp("uneven") / "llama", hidden_size=72, num_heads=9, num_kv_heads=3)


TP_CELL = """%%all
import torch, torch.distributed as dist
seen = []
hook = model.model.layers[1].register_forward_hook(lambda m, a, out: seen.append(tuple(out[0].shape \
if isinstance(out, tuple) else out.shape)))
ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
with torch.no_grad():
    logits = model(ids).logits
hook.remove()
top = int(logits[0, -1].argmax())
agree = torch.tensor([top]); dist.all_reduce(agree)
print("TP", dist.get_rank(), tuple(logits.shape), seen, agree.item() == 2 * top)
"""


def test_tp_layout_in_the_kernel(kernel, uneven):
    ex = load(kernel, uneven, "--parallel.decode tp")
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "tp — set by parallel.decode" in summary
    table = kernel.run("%shards model.layers.0.self_attn").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    rows = {line.split()[0]: line for line in table.splitlines() if line.startswith("model.layers.0.self_attn.")}
    # 6 query heads of 8 dims on rank 0, 3 on rank 1; o_proj split by the same heads, on its columns
    assert "tp: rows (dim 0) over 2 rank(s), uneven" in rows["model.layers.0.self_attn.q_proj.weight"]
    assert rows["model.layers.0.self_attn.q_proj.weight"].endswith("[48, 72]  [24, 72]")
    assert rows["model.layers.0.self_attn.o_proj.weight"].endswith("[72, 48]  [72, 24]")
    ex = kernel.run(TP_CELL)
    lines = [line.split(maxsplit=2) for line in ex.stdout().splitlines() if line.startswith("TP ")]
    assert sorted(rank for _, rank, _ in lines) == ["0", "1"], ex.stdout() + ex.error_text()
    for _, rank, rest in lines:
        num_tokens = rest.split(",")[1].strip()
        # whole logits on every rank, the hook saw the whole hidden state, every rank picks the same token
        assert rest == f"(1, {num_tokens}, 384) [(1, {num_tokens}, 72)] True", (rank, rest)
    chat = kernel.run("%%chat --output text --max-new-tokens 8\nhello")
    assert chat.status == "ok", chat.error_text() + chat.stderr()
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"  # loading again


def test_tp_for_a_model_with_too_few_heads_is_a_clear_error(kernel, tmp_path):
    two_heads = make_tiny_llama(tmp_path / "two-heads", num_heads=1, num_kv_heads=1)
    ex = load(kernel, two_heads, "--parallel.decode tp")
    assert ex.status == "error"
    assert "1 attention heads, fewer than the 2 ranks" in ex.error_text() + ex.stderr()
    assert_usable(kernel)


def test_moe_with_expert_parallelism_in_the_kernel(kernel, tmp_path):
    """Qwen2-MoE (8 experts and a shared expert) with ep_size 2: expert placements, a sampled chat, bad sizes."""
    moe = make_tiny_moe(tmp_path / "qwen2-moe", "qwen2_moe")
    for bad, words in [
        ("3", "not divisible by parallel.ep_size x parallel.ep_fsdp_size = 3 x 1"),
        ("16", "not divisible by parallel.ep_size x parallel.ep_fsdp_size = 16 x 1"),
    ]:
        ex = load(kernel, moe, f"--parallel.ep_size {bad}")
        assert ex.status == "error" and words in ex.error_text() + ex.stderr(), ex.error_text() + ex.stderr()
        assert_usable(kernel)
    ex = load(kernel, moe, "--parallel.ep_size 2")
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "tp — parallel.ep_size x ep_fsdp_size = 2" in summary and "mesh (edp=1, efsdp=1, ep=2)" in summary
    table = kernel.run("%shards model.layers.1.mlp.experts").of_type("execute_result")[0]["content"]["data"][
        "text/plain"
    ]
    row = [line for line in table.splitlines() if line.startswith("model.layers.1.mlp.experts.gate_up_proj")][0]
    assert "tp: experts (dim 0) over 2 rank(s)" in row and row.endswith("[4, 64, 64]  [4, 64, 64]"), row
    chat = kernel.run("%%chat --output text --do-sample --seed 3 --temperature 1.2 --max-new-tokens 12\nhello")
    assert chat.status == "ok", chat.error_text() + chat.stderr()
    assert "generated" in chat.stdout()
    assert_usable(kernel)


def test_loading_again_frees_the_previous_model(kernel, tiny):
    assert load(kernel, tiny).status == "ok"
    assert kernel.run("%%all\nimport weakref\nold_model = weakref.ref(model)").status == "ok"
    assert load(kernel, tiny).status == "ok"
    ex = kernel.run("%%all\nimport gc; gc.collect()\nprint('freed', old_model() is None)")
    assert ex.stdout().count("freed True") == 2, ex.stdout()


def test_bad_inputs_leave_the_kernel_usable(kernel, tiny, tmp_path):
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("model:\n  dtype: float32\n   oops: [\n")
    cases = [
        (f"--model.model_name_or_path {tmp_path / 'missing'}", "does not exist"),
        (f"--model.model_name_or_path {make_tiny_non_causal(tmp_path / 'bert')}", "causal"),
        (str(bad_yaml), "line"),
        ("--inference.max_new_token 3", "did you mean 'inference.max_new_tokens'"),
        (f"--model.model_name_or_path {tiny} --parallel.fsdp_size 3", "fsdp_size"),
        (
            f"--model.model_name_or_path {tiny} --parallel.ep_size 2",
            "apply to mixture-of-experts models, but llama has no experts",
        ),
        ("--model.model_name_or_path no-such-demo", "or a demo model name: smollm2-135m-instruct"),
    ]
    for args, expected in cases:
        ex = kernel.run(f"%load_sharded {args}")
        shown = ex.stderr() + ex.error_text()
        assert ex.status == "error", args
        assert expected in shown, (args, shown)
    assert_usable(kernel)


def test_unfetched_demo_model_and_use_before_load(fresh_kernel, tmp_path):
    handle = fresh_kernel(SHARDBOOK_HOME=str(tmp_path / "empty-home"))
    ex = handle.run("%shards")
    assert ex.status == "error" and "%load_sharded" in ex.stderr()
    ex = handle.run("%load_sharded configs/smollm2-135m.yaml")
    assert ex.status == "error" and "shardbook fetch smollm2-135m-instruct" in ex.stderr()


@contextlib.contextmanager
def mapped_view_replaced(kernel, where: str, body: str):
    """On the ranks ``where`` selects (``%%all``, ``%%rank 1``), reading a mapped tensor runs ``body``
    (one line; ``original_view`` is the real reader)."""
    patch = (
        f"{where}\nfrom shardbook.rankd.loading.safetensors_files import MappedFiles\n"
        "original_view = MappedFiles.view\n"
        f"def replaced_view(self, stored):\n    {body}\nMappedFiles.view = replaced_view"
    )
    assert kernel.run(patch).status == "ok"
    try:
        yield
    finally:
        kernel.run(f"{where}\nMappedFiles.view = original_view")


def test_read_failure_on_one_rank_fails_every_rank_cleanly(kernel, tiny):
    """Simulated on rank 1 only: mapping a checkpoint file raises there."""
    with mapped_view_replaced(kernel, "%%rank 1", "raise OSError('disk on fire')"):
        ex = load(kernel, tiny)
    shown = ex.error_text() + ex.stderr()
    assert ex.status == "error"
    assert "disk on fire" in shown and "rank 1" in shown, shown
    assert_usable(kernel)
    assert load(kernel, tiny).status == "ok"


def test_interrupt_during_a_load_stops_every_rank_together(kernel, tiny):
    """Every rank reads 0.3 s per tensor here, so the interrupt lands while the weights are read."""
    assert load(kernel, tiny).status == "ok"  # the model the interrupted load must leave in place

    def reading(msg):
        return msg["msg_type"] == "comm_msg" and "reading weights" in str(msg["content"]["data"].get("state", {}))

    with mapped_view_replaced(kernel, "%%all", "import time; time.sleep(0.3); return original_view(self, stored)"):
        ex, seconds = interrupt_when(kernel, f"%load_sharded --model.model_name_or_path {tiny}", reading)
    assert seconds < 3.0
    shown = ex.error_text() + ex.stderr()
    assert ex.status == "error" and "interrupted" in shown and "%load_sharded" in shown, shown
    assert "did not stop" not in shown, shown  # no rank left inside a collective
    assert_usable(kernel)
    # the model loaded before the interrupted load is still there, on every rank, and still works
    assert "the loaded model (LlamaForCausalLM from" in shown and "is still loaded" in shown, shown
    assert_forward_works(kernel)
    assert load(kernel, tiny).status == "ok"


def assert_forward_works(kernel):
    """`model` is loaded on both ranks and runs a forward (a collective over its shards)."""
    ex = kernel.run(
        "%%all\nimport torch\nwith torch.no_grad():\n"
        "    print('logits', tuple(model(torch.tensor([[1, 2, 3]])).logits.shape))"
    )
    assert ex.status == "ok" and ex.stdout().count("logits (1, 3, 384)") == 2, ex.error_text() + ex.stdout()


def test_a_failed_load_keeps_the_model_already_loaded(kernel, tiny, tmp_path):
    assert load(kernel, tiny).status == "ok"
    assert kernel.run("%%all\nimport weakref\nbefore = weakref.ref(model)").status == "ok"
    for case, path in make_broken_checkpoints(tmp_path).items():
        ex = load(kernel, path)
        assert ex.status == "error", case
        assert f"the loaded model (LlamaForCausalLM from {tiny}) is still loaded" in ex.stderr(), (case, ex.stderr())
        assert kernel.run("%%all\nprint('same', model is before())").stdout().count("same True") == 2, case
    assert_forward_works(kernel)


FORWARD_CELL = """%%all
import torch, torch.distributed as dist
ids = tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
with torch.no_grad():
    last = model(ids).logits[0, -1].float()
print("LOGITS", dist.get_rank(), last[:6].tolist())
"""


def forward_logits(kernel) -> dict[str, str]:
    ex = kernel.run(FORWARD_CELL)
    lines = [line.split(maxsplit=2) for line in ex.stdout().splitlines() if line.startswith("LOGITS ")]
    assert len(lines) == 2, ex.stdout() + ex.error_text() + ex.stderr()
    return {rank: values for _, rank, values in lines}


def alone_logits(kernel) -> str:
    ex = kernel.run("with torch.no_grad():\n    print('ALONE', model(ids).logits[0, -1].float()[:6].tolist())")
    assert ex.stdout().startswith("ALONE "), ex.stdout() + ex.error_text()
    return ex.stdout().split(maxsplit=1)[1].strip()


@pytest.mark.skipif(not packing_available(), reason="needs a CPU with AMX or AVX512-BF16 (nothing is packed here)")
@pytest.mark.parametrize("layout", ["tp", "gather"])
def test_a_weight_edited_through_data_is_seen_by_the_next_cells_forward(kernel, tiny, layout):
    """The load packs every bfloat16 linear for oneDNN; an edit through `.data` (which no version counter sees), in a
    `%%all` cell or in a plain cell on rank 0 alone, reaches the next cell's forward on every rank."""
    assert load(kernel, tiny, f"--parallel.decode {layout}", "--model.dtype bfloat16").status == "ok"
    packed = kernel.run(
        "%%all\nfrom shardbook.rankd.parallel.packed_linear import _packed\nprint('PACKED', len(_packed))"
    )
    assert packed.stdout().count("PACKED 15") == 2, packed.stdout()  # 2 layers of 7 linears, and the output layer
    before = forward_logits(kernel)
    down = "model.model.layers[0].mlp.down_proj.weight"
    assert kernel.run(f"%%all\nsaved = {down}.detach().clone()\n{down}.data.mul_(-4)").status == "ok"
    edited = forward_logits(kernel)
    assert all(edited[rank] != before[rank] for rank in before), (before, edited)
    assert kernel.run(f"%%all\n{down}.data.copy_(saved)").status == "ok"
    assert forward_logits(kernel) == before
    if layout == "gather":  # forwards on rank 0 alone (its weights gathered: no collective), in plain cells
        assert alone_logits(kernel) == before["0"]
    assert kernel.run(f"{down}.data.mul_(-4)").status == "ok"  # rank 0's own weight (under tp, its rows only)
    if layout == "gather":
        assert alone_logits(kernel) != before["0"]
    assert forward_logits(kernel)["0"] != before["0"]
    assert kernel.run(f"%%all\n{down}.data.copy_(saved)").status == "ok"
