"""GLM-5 (a tiny random `glm_moe_dsa`) in the real 2-rank kernel, loaded from a MindSpeed FSDP2-style YAML.

The YAML keeps MindSpeed's `data`, `training` and `optimization` sections; everything else comes from
command-line overrides, as a MindSpeed user would launch it. One kernel (the shared one) for all of it:
load under tp with ep 2, %%chat with a reply of a set length, seeded sampling at two lengths, an
interrupt that stops every rank, %shards, %%trace of the attention outputs against one process, an %intervene
that zeroes an attention output changing the logits as it does in one process (and removed cleanly), %serve
answering through the openai client, and loading the model again.
"""

from __future__ import annotations

import pytest
from openai import OpenAI

from tests.driver import interrupt_when
from tests.e2e.http_helpers import server_url
from tests.e2e.test_chat import replying
from tests.e2e.test_load import assert_usable
from tests.tiny import make_tiny_mla, never_ending

pytestmark = pytest.mark.timeout(300)

MINDSPEED_YAML = """\
model:
  model_name_or_path: /path/to/GLM-5
  dtype: float32
data:
  dataset: /path/to/alpaca
  cutoff_len: 4096
training:
  per_device_train_batch_size: 1
  seed: 42
  lr: 1.25e-06
optimization:
  optimizer: adamw
  weight_decay: 0.01
"""

OVERRIDES = (
    "--parallel.fsdp_size 2 --parallel.ep_size 2 --parallel.ep_fsdp_size 1 "
    "--inference.infer_backend huggingface --parallel.decode tp --inference.system_prompt none"
)

ONE_PROCESS = """
import torch
from transformers import AutoModelForCausalLM
single = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
seen = {{}}
hooks = [layer.self_attn.register_forward_hook(lambda m, a, out, i=i: seen.__setitem__(i, out[0][0]))
         for i, layer in enumerate(single.model.layers)]
with torch.no_grad():
    single(torch.tensor([_trace.token_ids]))
got = {{i: _trace[f"model.layers.{{i}}.self_attn"][0] for i in seen}}
ok = [torch.allclose(got[i], want, atol=1e-4, rtol=1e-4) for i, want in seen.items()]
print("ATTN", len(ok), all(ok))
"""


@pytest.fixture(scope="module")
def glm5(tmp_path_factory):
    """A tiny GLM-5 that never ends a reply by itself (end of text suppressed), and the MindSpeed YAML."""
    root = tmp_path_factory.mktemp("glm5")
    path = never_ending(make_tiny_mla(root / "model", "glm_moe_dsa"))
    yaml = root / "glm5-fsdp2.yaml"
    yaml.write_text(MINDSPEED_YAML)
    return path, yaml


def test_glm5_from_a_mindspeed_yaml_in_the_kernel(kernel, glm5):
    path, yaml = glm5
    ex = kernel.run(f"%load_sharded {yaml} --model.model_name_or_path {path} {OVERRIDES}", timeout=180)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    summary = ex.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "GlmMoeDsaForCausalLM" in summary and "mesh (edp=1, efsdp=1, ep=2)" in summary, summary
    chat = kernel.run("%%chat --output text --max-new-tokens 12\nhello", timeout=120)
    assert chat.status == "ok" and "12 generated" in chat.stdout(), chat.stdout() + chat.error_text()
    for length in (5, 17):
        sampled = f"%%chat --new --output text --do-sample --seed 11 --temperature 1.3 --max-new-tokens {length}\nhi"
        ex = kernel.run(sampled, timeout=120)
        assert ex.status == "ok" and f"{length} generated" in ex.stdout(), ex.stdout() + ex.error_text()
    code = "%%chat --new --max-new-tokens 200 --do-sample --temperature 2.0\nramble on"
    ex, _seconds = interrupt_when(kernel, code, replying)
    assert ex.status == "ok", ex.error_text()
    assert kernel.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"].count("idle") == 2
    assert_usable(kernel)


def test_glm5_shards_and_trace_match_one_process(kernel, glm5):
    path, _ = glm5
    table = kernel.run("%shards model.layers.1").of_type("execute_result")[0]["content"]["data"]["text/plain"]
    lines = [" ".join(line.split()) for line in table.splitlines() if line.startswith("model.layers.1.")]
    rows = {line.split()[0]: line for line in lines}
    # 5 heads of (8 + 16) kv_b_proj rows: 3 and 2 per rank; 8 experts, 4 per rank; the latent projection whole
    assert rows["model.layers.1.self_attn.kv_b_proj.weight"].endswith("[72, 16] [48, 16]"), table
    assert "tp: experts (dim 0) over 2 rank(s)" in rows["model.layers.1.mlp.experts.gate_up_proj"], table
    ex = kernel.run("%%trace --modules model.layers.*.self_attn\nThe capital of France is", timeout=120)
    assert ex.status == "ok", ex.error_text() + ex.stderr()
    check = kernel.run(ONE_PROCESS.format(path=str(path)), timeout=120)
    assert "ATTN 3 True" in check.stdout(), check.stdout() + check.error_text()


ZERO_ATTENTION = """%%all
def zero_attention(output, module_name):
    return output * 0
"""

ZEROED_IN_ONE_PROCESS = """
import torch
from transformers import AutoModelForCausalLM
single = AutoModelForCausalLM.from_pretrained({path!r}, dtype=torch.float32).eval()
hook = single.model.layers[1].self_attn.o_proj.register_forward_hook(lambda m, a, out: out * 0)
with torch.no_grad():
    want = single(torch.tensor([zeroed.token_ids])).logits.reshape(-1)
hook.remove()
got, before = zeroed.logits.reshape(-1), base.logits.reshape(-1)
print("ZEROED", bool(((got - want).abs() <= 1e-4 * (1 + want.abs())).all()), not torch.allclose(got, before),
      torch.equal(back.logits, base.logits))
"""


def test_glm5_intervene_serve_and_load_again(kernel, glm5):
    path, yaml = glm5
    prompt = "The capital of France is"
    assert kernel.run(ZERO_ATTENTION).status == "ok"
    assert kernel.run(f"%%trace --as base\n{prompt}", timeout=120).status == "ok"
    ex = kernel.run("%intervene zero_attention model.layers.1.self_attn.o_proj")
    assert "zero_attention on the output of model.layers.1.self_attn.o_proj" in ex.stdout(), ex.error_text()
    zeroed = kernel.run(f"%%trace --as zeroed\n{prompt}", timeout=120)
    assert zeroed.status == "ok", zeroed.error_text() + zeroed.stderr()
    kernel.run("%intervene --clear")
    assert "no interventions" in kernel.run("%intervene").stdout()
    assert kernel.run(f"%%trace --as back\n{prompt}", timeout=120).status == "ok"
    check = kernel.run(ZEROED_IN_ONE_PROCESS.format(path=str(path)), timeout=120)
    assert "ZEROED True True True" in check.stdout(), check.stdout() + check.error_text()

    url = server_url(kernel.run("%serve --port 0").stdout())
    try:
        client = OpenAI(base_url=url, api_key="unused")
        [served] = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=served, messages=[{"role": "user", "content": "hello"}], max_tokens=5
        )
        assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 5, reply
    finally:
        assert kernel.run("%serve --stop").status == "ok"

    again = kernel.run(f"%load_sharded {yaml} --model.model_name_or_path {path} {OVERRIDES}", timeout=180)
    assert again.status == "ok", again.error_text() + again.stderr()
    summary = again.of_type("execute_result")[0]["content"]["data"]["text/plain"]
    assert "GlmMoeDsaForCausalLM" in summary and "mesh (edp=1, efsdp=1, ep=2)" in summary, summary
    chat = kernel.run("%%chat --new --output text --max-new-tokens 4\nhello", timeout=120)
    assert chat.status == "ok" and "4 generated" in chat.stdout(), chat.stdout() + chat.error_text()
    assert_usable(kernel)
