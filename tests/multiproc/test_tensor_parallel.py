"""The `tp` layout on 2 gloo ranks: one process's logits per family, half the weights per rank,
hooks that see it all."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.multiproc.test_loading import prompt_ids, single_process
from tests.tiny import make_tiny_lm

FAMILIES = {
    # the demo model's uneven heads (9 over 3 KV heads: 6 and 3 per rank), tied embeddings
    "llama-uneven-tied": dict(family="llama", hidden_size=72, num_heads=9, num_kv_heads=3),
    # one KV head for 2 ranks (multi-query attention): both keep it, the query heads split
    "llama-mqa-untied": dict(family="llama", num_heads=4, num_kv_heads=1, tie_word_embeddings=False),
    "qwen2-qkv-bias": dict(family="qwen2", num_heads=6, num_kv_heads=2),
    "qwen3-qk-norm": dict(family="qwen3", num_heads=4, num_kv_heads=2),
}


def load_tp(rank: int, path: Path):
    from shardbook.rankd.config.schema import ModelConfig, ParallelConfig, ShardbookConfig
    from shardbook.rankd.loading.load_sharded import load_sharded

    config = ShardbookConfig(
        model=ModelConfig(model_name_or_path=str(path), dtype="float32"), parallel=ParallelConfig(decode="tp")
    )
    return load_sharded(config, device="cpu")


def logits_and_layers(rank: int, path: Path) -> dict:
    """The prompt's logits, each decoder layer's output as a forward hook sees it, and what this rank holds."""
    loaded = load_tp(rank, path)
    model = loaded.model
    seen = {}
    hooks = [
        layer.register_forward_hook(
            lambda module, args, out, i=i: seen.__setitem__(i, out[0] if isinstance(out, tuple) else out)
        )
        for i, layer in enumerate(model.model.layers)
    ]
    with torch.no_grad():
        logits = model(prompt_ids(loaded.tokenizer)).logits
    for hook in hooks:
        hook.remove()
    return {
        "logits": logits,
        "layers": [seen[i] for i in range(len(seen))],
        "held": held_bytes(model, path),
        "summary": loaded.summary,
        "tied": model.lm_head.weight is model.model.embed_tokens.weight,
    }


def held_bytes(model, path: Path) -> dict[str, int]:
    """This rank's parameter bytes, from `named_parameters` and from the storage behind them.

    A slice that is a view of the mapped checkpoint file (its storage is the whole file) counts
    its own bytes: those are the only pages of the file it ever touches. Any other storage
    counts whole, so a slice cut from a gathered copy would show.
    """
    file_sizes = {file.stat().st_size for file in path.glob("*.safetensors")}
    named = sum(p.numel() * p.element_size() for _, p in model.named_parameters())
    storages: dict[int, int] = {}
    for _, p in model.named_parameters():
        storage = p.untyped_storage()
        if storage.nbytes() in file_sizes:
            storages[p.data_ptr()] = p.numel() * p.element_size()
        else:
            storages[storage.data_ptr()] = storage.nbytes()
    return {"named": named, "storage": sum(storages.values())}


def hidden_states_of_one_process(path: Path) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model(prompt_ids(AutoTokenizer.from_pretrained(path)), output_hidden_states=True)
    # hidden_states[i + 1] is layer i's output, except the last, which has the final norm applied
    return [h for h in out.hidden_states[1:-1]]


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp_logits_match_one_process(ranks, tmp_path, name):
    path = make_tiny_lm(tmp_path / name, **FAMILIES[name])
    reference = single_process(path)
    results = ranks(logits_and_layers, path)
    for rank, result in enumerate(results):
        torch.testing.assert_close(result["logits"], reference["logits"], atol=1e-4, rtol=0, msg=f"rank {rank}")
        assert result["summary"]["decode"] == "tp" and result["summary"]["decode_reason"] == "set by parallel.decode"
        assert result["tied"] == FAMILIES[name].get("tie_word_embeddings", True)
    # hooks on decoder layers fire on every rank and see the whole hidden state
    expected = hidden_states_of_one_process(path)
    for rank, result in enumerate(results):
        assert len(result["layers"]) == len(expected) + 1
        for layer, (got, want) in enumerate(zip(result["layers"], expected)):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0, msg=f"rank {rank} layer {layer}")


def test_each_rank_holds_about_half_of_the_weights(ranks, tmp_path):
    path = make_tiny_lm(tmp_path / "uneven", family="llama", hidden_size=72, num_heads=9, num_kv_heads=3, num_layers=3)
    results = ranks(logits_and_layers, path)
    full = results[0]["summary"]["full_param_bytes"]
    assert full == sum(f.stat().st_size for f in path.glob("*.safetensors")) - _header_bytes(path)
    for rank, result in enumerate(results):
        assert result["held"]["named"] <= 0.55 * full, (rank, result["held"], full)
        assert result["held"]["storage"] <= 0.55 * full, (rank, result["held"], full)
        assert result["summary"]["local_param_bytes"][rank] == result["held"]["named"]
    # together the ranks hold the model once, plus the norms every rank keeps whole
    norms = sum(4 * 72 for _ in range(2 * 3 + 1))
    assert sum(r["held"]["named"] for r in results) == full + norms


def _header_bytes(path: Path) -> int:
    import struct

    total = 0
    for file in path.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += 8 + struct.unpack("<Q", f.read(8))[0]
    return total


def unsupported_family(rank: int, path: Path) -> str:
    try:
        load_tp(rank, path)
    except ValueError as e:
        return str(e)
    return "loaded"


def test_tp_for_an_unsupported_family_names_the_supported_ones(ranks, tmp_path):
    path = make_tiny_lm(tmp_path / "mistral", family="mistral", num_heads=4, num_kv_heads=2)
    for message in ranks(unsupported_family, path):
        assert "does not support 'mistral'" in message and "llama, qwen2, qwen3" in message
        assert "gather" in message and "reshard" in message
