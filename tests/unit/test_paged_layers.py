"""The batch's paged cache (`paged_layers`): each row's positions in blocks of its own, read by the C kernel. Rows
that join, decode across block boundaries and leave give the logits each row gets decoded alone in the left-padded
layout; memory follows each row's own length; joins and leaves move no row's blocks; what the kernel does not take
is gathered; a model that changes the stand-ins fails its step loudly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from shardbook.rankd.generation import decode_attention, paged_layers, row_attention
from shardbook.rankd.generation.batch_steps import BatchState, StepPlan, execute_step
from shardbook.rankd.generation.block_pool import MIN_BLOCKS
from shardbook.rankd.generation.growing_layers import kept_order
from shardbook.rankd.generation.paged_layers import PAGE_TOKENS, BlockTable, block_table, paged_refusal
from shardbook.rankd.generation.prefix_store import prefix_store
from tests.tiny import make_tiny_lm, make_tiny_mla, make_tiny_tp_family

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="no C compiler here: nothing is paged")

MAKERS = {
    "llama": lambda path: make_tiny_lm(path, family="llama"),
    "deepseek_v3": lambda path: make_tiny_mla(path, "deepseek_v3"),  # MLA: values of another head size
    "qwen3_next": lambda path: make_tiny_tp_family(path, "qwen3_next"),  # linear-attention states beside paged layers
    # the indexer's keys in blocks too (GLM-5: its third layer reuses the second's top-k and keeps none); 16 indexer
    # heads: with 2 (or 8, once here) exact ties at a zero score occur, which `topk` breaks its own way in a padded row
    "glm_moe_dsa": lambda path: make_tiny_mla(path, "glm_moe_dsa", index_n_heads=16),
    "deepseek_v32": lambda path: make_tiny_mla(path, "deepseek_v32", index_n_heads=16),
}


@pytest.fixture(scope="module", params=list(MAKERS))
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    path = MAKERS[request.param](tmp_path_factory.mktemp(request.param) / "model")
    return AutoModelForCausalLM.from_pretrained(Path(path), dtype=torch.float32).eval()


def _prompt(length: int, seed: int) -> list[int]:
    return torch.randint(10, 200, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


SCHEDULE = [  # (rows that leave, prompts that join by length, decode steps after)
    ([], [5, 40, 17], 20),  # row 1 crosses two block boundaries
    ([1], [30], 12),  # the long row leaves as a new one joins
    ([0], [3, 70], 6),
]


def _run_batch(model) -> tuple[dict[int, list[int]], dict[int, list[torch.Tensor]], BatchState, list[dict]]:
    """Run SCHEDULE in one batch, feeding each row its greedy tokens: each sequence's tokens and logits, the
    state, and after each join the table's blocks of the rows that were there before it."""
    prefix_store(model).forget_rows()  # the earlier tests' batches were never ended: their rows' blocks are free
    state, rows, tokens, logits, seen = BatchState(model, torch.device("cpu")), [], {}, {}, []
    for leave, joins, steps in SCHEDULE:
        new = list(range(len(tokens), len(tokens) + len(joins)))
        tokens.update({sid: _prompt(length, sid) for sid, length in zip(new, joins)})
        plan = StepPlan(leave=leave, decode=[], join=[(tokens[sid], False) for sid in new])
        table = block_table(state.cache) if rows else None
        held = {sid: list(table.blocks[row]) for row, sid in enumerate(rows)} if table else {}
        rows = [rows[i] for i in kept_order(len(rows), leave)]
        before = {sid: held[sid] for sid in rows if sid in held}
        outcome = _step(state, plan)
        table = block_table(state.cache)
        seen.append({sid: (blocks, list(table.blocks[rows.index(sid)])) for sid, blocks in before.items()})
        for sid, out in zip(new, outcome.joined):
            logits[sid] = [out[-1]]
        rows += new
        for _ in range(steps):
            feed = [int(logits[sid][-1].argmax()) for sid in rows]
            for sid, token in zip(rows, feed):
                tokens[sid].append(token)
            for sid, out in zip(rows, _step(state, StepPlan(leave=[], decode=feed, join=[])).decoded):
                logits[sid].append(out)
    return tokens, logits, state, seen


def _step(state: BatchState, plan: StepPlan):
    with torch.no_grad():
        outcome = execute_step(state, plan)
    assert not outcome.failure, outcome.errors
    return outcome


def _alone(model, tokens: list[int], prompt: int, monkeypatch) -> list[torch.Tensor]:
    """The logits of `tokens` (the first `prompt` of them the prompt) decoded alone, left-padded layout."""
    monkeypatch.setenv(paged_layers.SWITCH, "0")
    state = BatchState(model, torch.device("cpu"))
    out = [_step(state, StepPlan(leave=[], decode=[], join=[(tokens[:prompt], False)])).joined[0][-1]]
    for token in tokens[prompt:-1]:
        out.append(_step(state, StepPlan(leave=[], decode=[token], join=[])).decoded[0])
    assert block_table(state.cache) is None
    monkeypatch.delenv(paged_layers.SWITCH)
    return out


def test_rows_joining_decoding_and_leaving_give_the_left_padded_batchs_logits(model, monkeypatch) -> None:
    tokens, logits, state, _ = _run_batch(model)
    assert block_table(state.cache) is not None  # the batch was paged
    monkeypatch.setenv(paged_layers.SWITCH, "0")
    want_tokens, want, padded, _ = _run_batch(model)
    assert block_table(padded.cache) is None and tokens == want_tokens
    worst = max(float((a - b).abs().max()) for sid in want for a, b in zip(logits[sid], want[sid], strict=True))
    assert worst <= 1e-5, worst


def test_rows_joining_decoding_and_leaving_give_each_rows_logits_alone(model, monkeypatch) -> None:
    tokens, logits, _, _ = _run_batch(model)
    prompts = [length for _, joins, _ in SCHEDULE for length in joins]
    # Qwen3-Next's gated delta rule sums a padded batch in another order: its left-padded batch alone is 3e-5 off
    tolerance = 1e-4 if model.config.model_type == "qwen3_next" else 1e-5
    for sid, prompt in enumerate(prompts):
        alone = _alone(model, tokens[sid], prompt, monkeypatch)
        assert len(alone) == len(logits[sid]) - 1  # the batch's last logits were never fed on
        worst = max(float((a - b).abs().max()) for a, b in zip(logits[sid], alone))
        assert worst <= tolerance, f"sequence {sid}: {worst}"


def test_memory_follows_each_rows_own_length_and_joins_move_no_rows_blocks(model) -> None:
    tokens, _, state, seen = _run_batch(model)
    table = block_table(state.cache)
    lengths = table.lengths.tolist()
    assert table.held_blocks == sum(-(-length // PAGE_TOKENS) for length in lengths)
    assert max(lengths) > 2 * min(lengths)  # the rows differ: a left-padded cache would hold rows x longest
    assert all(before == after for step in seen for before, after in step.values())
    assert table.capacity == MIN_BLOCKS  # the leaving rows' blocks were taken again, no pool grew


def test_an_indexers_keys_are_in_blocks_beside_its_latents(model, monkeypatch) -> None:
    if "index_topk" not in model.config:
        pytest.skip("no sparse-attention indexer")
    _, _, state, _ = _run_batch(model)
    monkeypatch.setenv(paged_layers.SWITCH, "0")
    _, _, padded, _ = _run_batch(model)
    lengths = block_table(state.cache).lengths.tolist()
    indexed = [layer.paged_names for layer in state.cache.layers]
    reuses = model.config.model_type == "glm_moe_dsa"  # its third layer reuses the second's top-k
    assert indexed == [("keys", "values", "indexer_keys")] * (len(indexed) - reuses) + [("keys", "values")] * reuses
    for paged_layer, layer in zip(state.cache.layers, padded.cache.layers):
        for name in paged_layer.paged_names:
            for row, length in enumerate(lengths):
                got = paged_layers.row_positions(paged_layer, name, row)
                want = getattr(layer, name)[row][..., -length:, :]
                # a paged row attends over its own latents, a left-padded one over the padded width: the later
                # layers' inputs differ in the last bits (another summation order), a misplaced position by far more
                assert torch.allclose(got, want, atol=1e-5), (name, row)


def test_attention_the_kernel_does_not_take_reads_the_gathered_padded_rows(model, monkeypatch) -> None:
    want_tokens, want, _, _ = _run_batch(model)
    monkeypatch.setattr(row_attention, "_plain", lambda kw: False)  # as with sinks or a soft cap

    def no_kernel(*args, **kwargs):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(decode_attention, "paged_decode_attention", no_kernel)
    tokens, got, _, _ = _run_batch(model)
    assert tokens == want_tokens
    assert all(torch.allclose(a, b, atol=1e-5) for sid in want for a, b in zip(got[sid], want[sid]))


def test_a_stand_in_that_never_reaches_attention_fails_the_forward_naming_the_switch(model) -> None:
    state = BatchState(model, torch.device("cpu"))
    _step(state, StepPlan(leave=[], decode=[], join=[(_prompt(6, 1), False)]))
    layer = next(layer for layer in state.cache.layers if paged_layers.is_paged(layer))
    assert layer.stand_ins == (getattr(model.config, "kv_lora_rank", None) is None)  # MLA gets its latents gathered
    layer.stand_ins = True
    table = block_table(state.cache)
    table.begin_step()
    key = torch.zeros(1, layer.key_pool.shape[1], 1, layer.key_pool.shape[3])
    value = torch.zeros(1, layer.value_pool.shape[1], 1, layer.value_pool.shape[3])
    with pytest.raises(RuntimeError, match=paged_layers.SWITCH):
        with paged_layers.markers_expected():
            layer.update(key, value)  # the stand-ins go nowhere
    with pytest.raises(RuntimeError, match="row_positions"):
        layer.keys  # noqa: B018


def test_a_block_table_gives_leaving_rows_blocks_to_the_next_rows() -> None:
    table = BlockTable()
    table.add_rows([16, 1, 40])
    assert table.blocks == [[0], [1], [2, 3, 4]] and table.width == 40
    table.keep([0, 1])
    table.add_rows([33])
    assert sorted(table.blocks[2]) == [2, 3, 4] and table.capacity == MIN_BLOCKS
    table.begin_step()  # row 0 (16 positions) and row 2 (33: its third block has room) and row 1
    assert len(table.blocks[0]) == 2 and len(table.blocks[1]) == 1 and table.lengths.tolist() == [17, 2, 34]
    table.end_step()
    assert table.width == 34  # the mask's columns: the longest row
    table.add_rows([16] * MIN_BLOCKS)
    assert table.capacity > MIN_BLOCKS  # used up: the pools grow


def test_what_is_not_paged_says_why(model, monkeypatch) -> None:
    cpu = torch.device("cpu")
    assert paged_refusal(model, cpu) is None
    assert "cuda" in paged_refusal(model, torch.device("cuda"))
    monkeypatch.setattr(model.config, "_attn_implementation", "eager")
    assert "sdpa" in paged_refusal(model, cpu)
    monkeypatch.setattr(model.config, "_attn_implementation", "sdpa")
    monkeypatch.setenv(paged_layers.SWITCH, "0")
    assert paged_layers.SWITCH in paged_refusal(model, cpu)


def test_sliding_windows_stay_left_padded(tmp_path: Path) -> None:
    path = make_tiny_tp_family(tmp_path / "gpt_oss", "gpt_oss")
    loaded = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    loaded.config._attn_implementation = "sdpa"  # gpt-oss attends eagerly (sinks): its cache alone refuses
    reason = paged_refusal(loaded, torch.device("cpu"))
    assert reason is not None and "DynamicSlidingWindowLayer layers, which are not paged" in reason
