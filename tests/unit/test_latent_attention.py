"""The batch's decode step attends over MLA's cached latents directly (`rankd/generation/latent_attention.py`): the
logits equal those of the expanded keys and values within 1e-5, paged or left-padded, for DeepSeek-V3's MLA and
GLM-5's and DeepSeek-V3.2's sparse MLA (which read only their indexer's top-k columns); the absorbed path is really
taken (its calls counted); an up-projection with a hook on it is expanded, so the hook sees every step; a few new
tokens over a history attend over the latents too (a whole prompt's prefill expands, which costs less there), and so
does a reply generated alone; a stand-in that never reaches attention fails the step naming the switch."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardbook.rankd.generation import latent_attention, paged_layers
from shardbook.rankd.generation.batch_steps import BatchState, Chunk, StepPlan, execute_step
from shardbook.rankd.generation.engine import GenerationRequest, generate
from shardbook.rankd.generation.latent_attention import LatentKeys
from tests.tiny import make_tiny_mla
from tests.unit.test_paged_layers import _run_batch

FAMILIES = {"deepseek_v3": {}, "glm_moe_dsa": {"index_n_heads": 16}, "deepseek_v32": {"index_n_heads": 16}}


@pytest.fixture(scope="module", params=list(FAMILIES))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = make_tiny_mla(tmp_path_factory.mktemp(request.param) / "model", request.param, **FAMILIES[request.param])
    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()


@pytest.fixture
def attends(monkeypatch) -> list[tuple[int, int]]:
    """The rows and queries of every call of `LatentKeys.attend`."""
    calls: list[tuple[int, int]] = []
    attend = LatentKeys.attend
    record = lambda self, q, *a: calls.append((q.shape[0], q.shape[2])) or attend(self, q, *a)  # noqa: E731
    monkeypatch.setattr(LatentKeys, "attend", record)
    return calls


@pytest.mark.parametrize("paged", ["1", "0"])
def test_absorbed_decode_gives_the_expanded_logits(model, paged: str, attends: list, monkeypatch) -> None:
    monkeypatch.setenv(paged_layers.SWITCH, paged)
    sparse: list[bool] = []
    picked = latent_attention._picked_columns
    monkeypatch.setattr(
        latent_attention, "_picked_columns", lambda *a: sparse.append(picked(*a) is not None) or picked(*a)
    )
    tokens, logits, _, _ = _run_batch(model)
    assert attends, "the decode steps never attended over the latents"
    # GLM-5 and DeepSeek-V3.2 read only the indexer's top-4 columns once rows are longer than 8; DeepSeek-V3 all
    assert any(sparse) == ("index_topk" in model.config)
    monkeypatch.setenv(latent_attention.SWITCH, "0")
    taken = len(attends)
    want_tokens, want, _, _ = _run_batch(model)
    assert len(attends) == taken, "the switch did not turn the absorbed path off"
    assert tokens == want_tokens
    worst = max(float((a - b).abs().max()) for sid in want for a, b in zip(logits[sid], want[sid], strict=True))
    assert worst <= 1e-5, worst


def _chunked_prompt_logits(model) -> torch.Tensor:
    """A 40-token prompt fed in two pieces, 32 then 8 (over the first 32): the second piece's logits."""
    tokens = torch.randint(10, 200, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    state, pieces = BatchState(model, torch.device("cpu")), [(0, 32, False), (32, 40, True)]
    with torch.no_grad():
        for start, end, last in pieces:
            plan = StepPlan(leave=[], decode=[], join=[], chunk=Chunk(tokens[start:end], start, last, all_logits=True))
            outcome = execute_step(state, plan)
            assert not outcome.failure, outcome.errors
    return outcome.chunked


def test_a_few_new_tokens_over_a_history_attend_over_the_latents(model, attends: list, monkeypatch) -> None:
    got = _chunked_prompt_logits(model)
    layers = sum(1 for m in model.modules() if hasattr(m, "kv_b_proj"))
    assert attends == [(1, 8)] * layers  # the 32 tokens of the first piece cost less expanded: not over latents
    monkeypatch.setenv(latent_attention.SWITCH, "0")
    want = _chunked_prompt_logits(model)
    assert got.shape == want.shape == (8, model.config.vocab_size)
    assert float((got - want).abs().max()) <= 1e-5


def _reply_alone(model) -> list[tuple[int, float]]:
    """A greedy reply of 6 tokens through the single-reply path (`engine.generate`): each token and its probability."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model.name_or_path)
    messages = [{"role": "user", "content": "one two three four five six seven"}]
    request = GenerationRequest(messages=messages, seed=0, max_new_tokens=6, want_scores=True)
    result = generate(model, tokenizer, request, device="cpu", on_text=None, stop_event=threading.Event())
    return [(score.token_id, score.prob) for score in result.scores]


def test_a_reply_generated_alone_attends_over_the_latents(model, attends: list, monkeypatch) -> None:
    got = _reply_alone(model)
    assert attends and all(rows == 1 for rows, _ in attends)  # its decode steps went over the latents
    monkeypatch.setenv(latent_attention.SWITCH, "0")
    want = _reply_alone(model)
    assert [token for token, _ in got] == [token for token, _ in want]
    assert max(abs(a - b) for (_, a), (_, b) in zip(got, want, strict=True)) <= 1e-5


def _decode_two_rows(model) -> None:
    state = BatchState(model, torch.device("cpu"))
    with torch.no_grad():
        outcome = execute_step(state, StepPlan(leave=[], decode=[], join=[([5, 6, 7], False), ([8, 9], False)]))
        assert not outcome.failure, outcome.errors
        return execute_step(state, StepPlan(leave=[], decode=[11, 12], join=[]))


def test_a_hooked_up_projection_is_expanded_so_its_hook_sees_the_step(model, attends: list) -> None:
    seen: list[tuple[int, ...]] = []
    up = next(m for m in model.modules() if hasattr(m, "kv_b_proj")).kv_b_proj
    handle = up.register_forward_hook(lambda module, args, out: seen.append(tuple(out.shape)))
    try:
        outcome = _decode_two_rows(model)
    finally:
        handle.remove()
    assert not outcome.failure, outcome.errors
    assert seen[-1][0] == 2, seen  # the decode step's two rows went through the hooked projection
    layers = sum(1 for m in model.modules() if hasattr(m, "kv_b_proj"))
    assert len(attends) == layers - 1  # every other MLA layer still attended over its latents


def test_a_stand_in_that_never_reaches_attention_fails_naming_the_switch(model, monkeypatch) -> None:
    monkeypatch.setattr(latent_attention, "take", lambda key, value: None)  # as a model that changed its keys
    outcome = _decode_two_rows(model)
    assert outcome.failure and latent_attention.SWITCH in str(outcome.errors), outcome.errors


@pytest.mark.parametrize("queries, masked", [(1, True), (3, True), (3, False)])  # no mask: causal
@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
def test_attention_over_latents_equals_sdpa_over_the_expansion(model, queries, masked, dtype, tolerance) -> None:
    module = next(m for m in model.modules() if hasattr(m, "kv_b_proj"))
    generator = torch.Generator().manual_seed(0)
    rows, columns, heads = 3, 21, module.kv_b_proj.weight.shape[0] // (module.qk_nope_head_dim + module.v_head_dim)
    latents = torch.randn(rows, 1, columns, module.kv_lora_rank, generator=generator)
    rotary = torch.randn(rows, 1, columns, module.qk_rope_head_dim, generator=generator)
    query = torch.randn(rows, heads, queries, module.qk_head_dim, generator=generator)
    causal = torch.arange(columns) <= torch.arange(columns - queries, columns)[:, None]  # the queries are the last
    padding = torch.arange(columns) >= torch.tensor([0, 5, 13])[:, None]  # left padding of three lengths
    mask = (causal & padding[:, None]) if masked else causal.expand(rows, queries, columns)
    with torch.no_grad():
        key, value = module.expand_kv(latents, rotary)
        want = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, mask[:, None], scale=module.scaling
        ).transpose(1, 2)
        module.kv_b_proj.to(dtype)
        try:
            cast = [t.to(dtype) for t in (latents, rotary, query)]
            given = mask[:, None] if masked else None
            got = LatentKeys(module, cast[0], cast[1]).attend(cast[2], given, module.scaling)
        finally:
            module.kv_b_proj.float()
    assert got.shape == want.shape
    assert float((got.float() - want).abs().max()) <= tolerance
