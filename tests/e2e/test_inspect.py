"""%%trace, %logit_lens, full_parameter/%param, %intervene and %share through a real 2-rank kernel, per layout."""

from __future__ import annotations

import base64

import pytest

from tests.e2e.test_load import assert_usable, load
from tests.tiny import make_tiny_llama

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """The demo model's head layout (9 query heads over 3 KV heads: 6 and 3 per rank under tp)."""
    return make_tiny_llama(tmp_path_factory.mktemp("inspect") / "llama", hidden_size=72, num_heads=9, num_kv_heads=3)


ONE_PROCESS = """
import torch
from transformers import AutoModelForCausalLM
single = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
with torch.no_grad():
    want = single(torch.tensor([_trace.token_ids]), output_hidden_states=True)
layers = [_trace[f"model.layers.{{i}}"][0] for i in range(len(single.model.layers))]
diffs = [(got - ref[0]).abs().max().item() for got, ref in zip(layers[:-1], want.hidden_states[1:-1])]
diffs.append((_trace.logits - want.logits[0]).abs().max().item())
weight = full_parameter("model.layers.1.self_attn.k_proj.weight")
same_weight = torch.equal(weight, single.state_dict()["model.layers.1.self_attn.k_proj.weight"])
lens_top = [row["top_tokens"][0] for row in _lens.rows if row["layer"] == "model.layers.1"]
model_top = [tokenizer.decode([i]) for i in want.logits[0].argmax(-1).tolist()]
print("CHECK", max(diffs) < 1e-4, same_weight, lens_top == model_top, tuple(weight.shape))
"""


@pytest.mark.parametrize("decode", ["gather", "reshard", "tp"])
def test_trace_lens_and_parameters_match_one_process(kernel, uneven, decode):
    assert load(kernel, uneven, f"--parallel.decode {decode}").status == "ok"
    ex = kernel.run("%%trace\nThe capital of France is")
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    assert "_trace: Trace of" in ex.stdout() and "model.layers.1: (1, " in ex.stdout()
    lens = kernel.run("%logit_lens The capital of France is")
    assert lens.status == "ok", lens.error_text() + lens.stderr()
    [png] = [
        m["content"]["data"]["image/png"] for m in lens.of_type("display_data") if "image/png" in m["content"]["data"]
    ]
    assert base64.b64decode(png).startswith(b"\x89PNG")
    check = kernel.run(ONE_PROCESS.format(path=str(uneven)), timeout=120)
    assert "CHECK True True True (24, 72)" in check.stdout(), check.stdout() + check.error_text()


def test_param_magic_and_completion(kernel, uneven):
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    ex = kernel.run("w = %param model.layers.0.mlp.down_proj.weight\nprint('SHAPE', tuple(w.shape))")
    assert "SHAPE (72, " in ex.stdout(), ex.error_text()
    reply = kernel.kc.complete("%param model.layers.0.self_attn.q", 33)
    matches = kernel.kc.get_shell_msg(timeout=30)["content"]["matches"]
    assert any(m.endswith("model.layers.0.self_attn.q_proj.weight") for m in matches), (reply, matches)
    missing = kernel.run("%param model.layers.0.self_attn.q_proj.wieght")
    assert missing.status == "error" and "did you mean model.layers.0.self_attn.q_proj.weight" in missing.error_text()
    too_big = kernel.run("%param model.embed_tokens.weight --max-mb 0.01")
    assert too_big.status == "error" and "over the limit of 0.0 MiB" in too_big.error_text()


INTERVENTIONS = """%%all
import torch, torch.distributed as dist

def zero(output, module_name):
    return output * 0

def fails_on_one(output, module_name):
    if dist.get_rank() == 1:
        raise RuntimeError("boom on purpose")

def heads_off(output, module_name):
    output[..., :24] = 0  # the first 3 query heads, which rank 0 holds under tp
"""


def test_interventions_under_tp(kernel, uneven):
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    assert kernel.run(INTERVENTIONS).status == "ok"
    base = kernel.run("%%trace --as base\nThe capital of France is")
    assert base.status == "ok", base.error_text()
    ex = kernel.run("%intervene zero model.layers.0")
    assert "zero on the output of model.layers.0" in ex.stdout(), ex.error_text()
    kernel.run("%%trace --as zeroed --modules model.layers.0\nThe capital of France is")
    kernel.run("%intervene heads_off model.layers.1.self_attn.o_proj --input")
    listed = kernel.run("%intervene").stdout()
    assert "heads_off on the input of model.layers.1.self_attn.o_proj" in listed and "zero on" in listed
    chat = kernel.run(
        "%%chat --output text --scores --max-new-tokens 6\nhello"
    )  # hooks with a gather, under synced_gpus
    assert chat.status == "ok", chat.error_text() + chat.stderr()
    [scores] = [
        m["content"]["data"]
        for m in chat.of_type("display_data")
        if "shardbook-scores" in m["content"]["data"].get("text/html", "")
    ]
    assert scores["text/html"].count("<span title=") == 6 and scores["text/plain"].count(":") >= 6
    kernel.run("%intervene --clear")
    kernel.run("%%trace --as back --modules model.layers.0\nThe capital of France is")
    ex = kernel.run(
        "print('ZERO', zeroed['model.layers.0'].abs().max().item(), torch.equal(back.logits, base.logits), "
        "torch.equal(zeroed.logits, base.logits))"
    )
    assert "ZERO 0.0 True False" in ex.stdout(), ex.stdout() + ex.error_text()


def test_user_errors_leave_the_kernel_usable(kernel, uneven):
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    assert kernel.run(INTERVENTIONS).status == "ok"
    bad = kernel.run("%%trace --modules model.layer.*\nhi")
    assert bad.status == "error" and "no module of the model matches 'model.layer.*'" in bad.error_text()
    big = kernel.run("%%trace --max-mb 0.001\nThe capital of France is")
    assert big.status == "error" and "over the limit of 0.0 MiB" in big.error_text()
    undefined = kernel.run("%intervene nowhere model.layers.0")
    assert undefined.status == "error" and "define it in an %%all cell first" in undefined.error_text()
    kernel.run("def only_on_rank0(output, module_name):\n    return output")  # a plain cell runs on rank 0 alone
    partial = kernel.run("%intervene only_on_rank0 model.layers.0").error_text()
    assert "rank 1: ValueError: no function named 'only_on_rank0'" in partial, partial
    assert "rank 0: ValueError: not registered on rank 0: another rank could not register it" in partial, partial
    assert "no interventions" in kernel.run("%intervene").stdout()  # all or nothing: not on rank 0 either
    kernel.run("%intervene fails_on_one model.layers.*.self_attn.q_proj")
    failed = kernel.run("%%trace\nThe capital of France is")
    text = failed.error_text()
    assert (
        failed.status == "error"
        and "intervention 'fails_on_one' raised on rank 1" in text
        and "boom on purpose" in text
    )
    assert "rank 0" not in text.split("RankError")[-1].split("----")[1]
    kernel.run("%intervene --remove fails_on_one")
    assert kernel.run("%%trace\nThe capital of France is").status == "ok"
    assert_usable(kernel)


def test_share_sends_a_tensor_to_every_rank(kernel, uneven):
    assert load(kernel, uneven).status == "ok"
    kernel.run("import torch\nsteer = torch.arange(6.0).reshape(2, 3)")
    assert "steer (1 tensor(s)) is now on every rank" in kernel.run("%share steer").stdout()
    ex = kernel.run(
        "%%all\nimport torch.distributed as dist\nprint('SUM', dist.get_rank(), steer.sum().item(), steer.shape)"
    )
    assert ex.stdout().count("SUM") == 2 and "SUM 1 15.0 torch.Size([2, 3])" in ex.stdout(), ex.stdout()


BLOCKING = """%%all
import os, time, torch.distributed as dist
def blocks_on_rank1(output, module_name):
    if dist.get_rank() == 1:
        open({entered!r}, "w").close()
        time.sleep(30)
        open({slept!r}, "w").close()
def loops_on_rank0(output, module_name):
    if dist.get_rank() == 0:
        open({entered!r}, "w").close()
        while True:
            pass"""

WAITS_FOR_THE_STOP = """%%all
from shardbook.rankd.control import user_calls
def wait_for_the_stop(module, args, output):  # a plain hook, no intervention: the stop does not interrupt it
    if dist.get_rank() == 1 and not os.path.exists({in_forward!r}):
        open({in_forward!r}, "w").close()
        deadline = time.monotonic() + 60
        while not user_calls.interrupted() and time.monotonic() < deadline:
            time.sleep(0.01)
hook = model.model.layers[0].mlp.register_forward_hook(wait_for_the_stop)"""


@pytest.mark.parametrize(
    "name, before", [("blocks_on_rank1", False), ("loops_on_rank0", False), ("blocks_on_rank1", True)],
    ids=["blocks_on_rank1", "loops_on_rank0", "before_the_function"],
)  # fmt: skip
def test_the_stop_button_reaches_a_blocking_intervention(kernel, uneven, tmp_path, name, before):
    """An intervention that sleeps (on a follower) or loops (on rank 0, in the batch thread) is interrupted
    inside the function on its rank, in the continuous batch (the reply's row fails, the batch goes on): the cell
    ends naming rank, function and module, and the next cell runs (before, the cell said "blocked inside a
    collective" and the ranks stayed busy 28 s). Pressed before the function is called (here rank 1 is held in
    layer 0 until the stop reaches it), the stop holds until a step has no intervened row: the function is
    interrupted as it starts instead of sleeping its 30 s (the 28 s once seen under load, where the stop had come
    before rank 1 got to the function).
    """
    from tests.driver import interrupt_when
    from tests.e2e.conftest import wait_until

    entered, slept, in_forward = tmp_path / "entered", tmp_path / "slept", tmp_path / "in_forward"
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    assert kernel.run(BLOCKING.format(entered=str(entered), slept=str(slept))).status == "ok"
    if before:
        assert kernel.run(WAITS_FOR_THE_STOP.format(in_forward=str(in_forward))).status == "ok"
    assert kernel.run(f"%intervene {name} model.layers.1.mlp").status == "ok"
    marker = in_forward if before else entered

    def moment(msg) -> bool:  # the ranks are in the forward (a follower's output does not reach the cell then)
        return wait_until(marker.exists, timeout=60)

    try:
        code = "%%chat --new --output text --max-new-tokens 50\nhello"
        ex, _ = interrupt_when(kernel, code, moment, wait_s=90, timeout=120)
        text = ex.error_text() + ex.stdout() + ex.stderr()
        assert not slept.exists(), text  # the function never ran to its end: the stop reached it
        rank = 1 if name == "blocks_on_rank1" else 0
        assert f"intervention {name!r} was interrupted on rank {rank} at model.layers.1.mlp" in text, text
        assert "blocked inside a collective" not in text, text
        assert "the reply failed: " in text, text  # its row of the continuous batch failed; the batch went on
    finally:
        kernel.run("%intervene --clear", timeout=60)
        if before:
            kernel.run("%%all\nhook.remove()", timeout=60)
    after = kernel.run("%%all\nprint('ALIVE', dist.get_rank())", timeout=60)
    assert after.status == "ok" and after.stdout().count("ALIVE") == 2, after.error_text()
    assert_usable(kernel)


DATASET_CHECK = """
import torch
from transformers import AutoModelForCausalLM
single = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
ids = [tokenizer(p, return_tensors="pt")["input_ids"] for p in prompts]
with torch.no_grad():
    outs = [single(i, output_hidden_states=True).hidden_states[1][0] for i in ids]
want = torch.cat(outs).mean(0)
same_mean = (mean["model.layers.0"] - want).abs().max().item() < 1e-4
same_each = all((t["model.layers.0"][0] - o).abs().max().item() < 1e-4 for t, o in zip(many, outs))
h = {{}}
single.model.layers[0].register_forward_hook(lambda m, a, o: h.setdefault("out", o[0] if isinstance(o, tuple) else o))
x = single(ids[0]).logits
want_grad = torch.autograd.grad(x[0, -1, 5] - x[0, -1, 17], h["out"])[0]
same_grad = (g.grads["model.layers.0"] - want_grad).abs().max().item() < 1e-4
print("CHECK", len(many), same_each, same_mean, same_grad, round(_patch.result["effect"].shape[0]))
"""


def test_batches_reductions_gradients_and_patching_through_the_kernel(kernel, uneven):
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    kernel.run('prompts = ["The capital of France is", "Hello", "The quick brown fox jumps over the lazy dog", "a b"]')
    many = kernel.run("many = %trace --prompts prompts --modules model.layers.0 --batch-size 3\nprint(repr(many))")
    assert many.status == "ok" and "Traces of 4 of 4 prompts" in many.stdout(), many.error_text() + many.stdout()
    mean = kernel.run("mean = %trace --prompts prompts --modules model.layers.0 --reduce mean")
    assert mean.status == "ok", mean.error_text()
    setup = kernel.run("%%all\ndef diff(logits):\n    return logits[0, -1, 5] - logits[0, -1, 17]\n")
    assert setup.status == "ok", setup.error_text()
    grad = kernel.run("%%trace --grad diff --modules model.layers.* --as g\nThe capital of France is")
    assert grad.status == "ok" and "with gradients of a metric" in grad.stdout(), grad.error_text()
    kernel.run('clean, corrupt = "The capital of France is", "The capital is France of"')
    patch = kernel.run("%patch --clean clean --corrupt corrupt --modules model.layers.* --metric diff")
    assert patch.status == "ok" and "activation patching: metric clean" in patch.stdout(), patch.error_text()
    check = kernel.run(DATASET_CHECK.format(path=str(uneven)), timeout=120)
    assert "CHECK 4 True True True 2" in check.stdout(), check.stdout() + check.error_text()


def test_backward_in_all_under_tp_through_the_kernel(kernel, uneven):
    """A backward in %%all and the whole input-embedding gradient (a 60 s wait once timed out on a loaded machine)."""
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    ex = kernel.run(
        "%%all\nfrom shardbook.rankd.parallel.wholes import full_gradient_on_rank0\n"
        "model.requires_grad_(True)\n"
        "x = model(tokenizer('The capital of France is', return_tensors='pt')['input_ids']).logits\n"
        "(x[0, -1, 5] - x[0, -1, 17]).backward()\n"
        "embed_grad = full_gradient_on_rank0(model, model.model.embed_tokens.weight)\n"
        "model.requires_grad_(False)\nmodel.zero_grad()\nprint('GRAD', embed_grad is not None)",
        timeout=180,
    )
    assert ex.status == "ok" and "GRAD True" in ex.stdout(), ex.error_text()


RANK_ONE_METRIC = """%%all
import torch.distributed as dist
seen_tokens = []

def broken_on_one(logits):
    if dist.get_rank() == 1:
        raise RuntimeError("metric boom on purpose")
    return logits[0, -1, 5] - logits[0, -1, 17]

def count_tokens(output, module_name):
    seen_tokens.append(output.shape[0] * output.shape[1])
"""


def test_a_metric_failing_on_one_rank_and_an_oversized_capture_are_refused(kernel, uneven):
    """A --grad or %patch metric raising on rank 1 only: every rank stops before the backward (or the next forward),
    naming rank 1, and the kernel still works. A batched trace whose captures would not fit on rank 0 is refused
    before any forward over the prompts: only the one-token probe reaches the model."""
    assert load(kernel, uneven, "--parallel.decode tp").status == "ok"
    assert kernel.run(RANK_ONE_METRIC).status == "ok"
    grad = kernel.run("%%trace --grad broken_on_one --modules model.layers.*\nThe capital of France is", timeout=120)
    text = grad.error_text()
    assert grad.status == "error" and "the metric 'broken_on_one' raised on rank 1" in text, text
    assert "metric boom on purpose" in text and "rank(s) [1] could not compute the metric" in text, text
    kernel.run('clean, corrupt = "The capital of France is", "The capital is France of"')
    patch = kernel.run("%patch --clean clean --corrupt corrupt --modules model.layers.* --metric broken_on_one")
    assert patch.status == "error" and "raised on rank 1" in patch.error_text(), patch.error_text()
    assert_usable(kernel)
    assert kernel.run("%intervene count_tokens model.layers.0").status == "ok"
    kernel.run("prompts = ['The capital of France is'] * 300")
    big = kernel.run("%trace --prompts prompts --max-mb 1")
    text = big.error_text()
    assert big.status == "error" and "these 300 prompts would need" in text and "so no prompt ran" in text, text
    kernel.run("%intervene --clear")
    seen = kernel.run("%%all\nprint('SEEN', seen_tokens)")
    assert seen.stdout().count("SEEN [1]") == 2, seen.stdout() + seen.error_text()  # the probe only, on each rank
    fits = kernel.run(
        "fits = %trace --prompts prompts --max-mb 1 --reduce mean --batch-size 64\nprint('FITS', fits.prompts)"
    )
    assert "FITS 300" in fits.stdout(), fits.stdout() + fits.error_text()
    assert_usable(kernel)
