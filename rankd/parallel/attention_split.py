"""How `tp` splits one attention module by heads: grouped-query attention and multi-head latent attention (MLA).

The plan says which projections are split (column: output rows, row: input columns); this module
says which rows each rank keeps, in whole heads, so every rank computes attention for its heads only.

Grouped-query attention (Llama, Qwen, GLM-4): q_proj rows by query heads, k/v_proj rows by the KV
heads those queries read (`head_split`), o_proj columns by query heads. A q_proj twice as wide
(Qwen3-Next: each head's query followed by its output gate) keeps twice the rows per query head.
Per-head parameters of the attention module itself (GPT-OSS's attention sinks, one logit per
query head) keep the rank's query heads.

MLA (DeepSeek-V3/V3.2, GLM-5 `glm_moe_dsa`): q_a_proj, kv_a_proj_with_mqa and their norms are
small and stay whole; every rank computes the same compressed latents from them. The per-head
up-projections q_b_proj (or q_proj without a query LoRA) and kv_b_proj keep the rank's heads
(each head has its own key and value, so heads split like multi-head attention), o_proj the
matching columns. The KV cache holds the compressed latent (kv_lora_rank + qk_rope_head_dim per
token and layer), which every head reads: it cannot be split by heads, so every rank keeps all of
it. That is still 2 x heads x head_dim / (kv_lora_rank + rope) times less than per-head keys and values.

The sparse-attention indexer (DeepSeek-V3.2, GLM-5) is replicated: it reads the hidden state and
q_a_proj's latent, both whole on every rank, so every rank computes the same scores with the same
arithmetic and picks the same top-k indices, with no collective. Per token and indexed layer that
costs every rank index_n_heads x index_head_dim x (q_lora_rank + past tokens) + hidden x
(index_head_dim + index_n_heads) multiply-adds (GLM-5 with 4k past tokens: 32 x 128 x (2048 + 4096)
+ 6144 x 160 = about 26 M per indexed layer) and index_head_dim values of key cache per token
(128, 256 bytes in bf16), the same on every rank. Splitting its heads instead would need an all-reduce of
[tokens x past tokens] scores before top-k for every indexed layer, more traffic than the work it saves.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from shardbook.rankd.parallel.head_split import HeadShare, split_heads


@dataclass(frozen=True)
class AttentionSplit:
    """Every rank's heads of one attention module, and how wide a head is in each projection."""

    shares: list[HeadShare]
    num_heads: int
    num_kv_heads: int
    head_dim: int | None
    """Rows per head of q/k/v (grouped-query attention); None for MLA, whose projections differ in head width."""

    @classmethod
    def of(cls, attn: nn.Module, config, parts: int) -> AttentionSplit:
        """The split of a layer's attention (of its first one where it has several alike: LongCat-Flash's two MLAs)."""
        attn = attention_modules(attn)[0]
        heads = config.num_attention_heads
        if is_mla(attn):
            return cls(split_heads(heads, heads, parts), heads, heads, None)
        kv = config.num_key_value_heads
        return cls(split_heads(heads, kv, parts), heads, kv, attn.head_dim)

    def pieces(self, module: nn.Linear, dim: int, name: str) -> list[tuple[range, ...]]:
        """Each rank's ranges of `module.weight`'s `dim` (0: a column-parallel output, 1: a row-parallel input)."""
        features = module.weight.shape[dim]
        if dim == 1 or self.head_dim is None:  # o_proj's input, or MLA's per-head projections: by query heads
            return [(_scaled(s.query_heads, features // self.num_heads),) for s in self.shares]
        if features == self.num_heads * self.head_dim:
            return [(_scaled(s.query_heads, self.head_dim),) for s in self.shares]
        if features == self.num_kv_heads * self.head_dim:
            return [_kv_pieces(s, self.head_dim) for s in self.shares]
        if features == 2 * self.num_heads * self.head_dim:  # a query and an output gate per head
            return [(_scaled(s.query_heads, 2 * self.head_dim),) for s in self.shares]
        raise ValueError(
            f"{name} has {features} output features, not whole query or key/value heads: tp cannot split it"
        )

    def per_head(self) -> list[tuple[range]]:
        """Each rank's query heads, for a parameter with one entry per query head (attention sinks)."""
        return [(s.query_heads,) for s in self.shares]

    def local_groups(self, rank: int) -> int:
        """The attention module's `num_key_value_groups` on `rank` (MLA: one key per query head)."""
        return 1 if self.head_dim is None else self.shares[rank].groups


def attention_modules(attn: nn.Module) -> list[nn.Module]:
    """A layer's `self_attn` as a list: LongCat-Flash holds two attentions per layer (a ModuleList), others one."""
    return list(attn) if isinstance(attn, nn.ModuleList) else [attn]


def is_mla(attn: nn.Module) -> bool:
    """Multi-head latent attention: keys and values come from a shared latent through `kv_b_proj`."""
    return hasattr(attn, "kv_b_proj")


def kv_cache_bytes_per_token(model: nn.Module, split: list[AttentionSplit | None], rank: int, element_size: int) -> int:
    """Bytes of KV cache one token adds on `rank`, over every layer (and the indexer's key cache where there is one).

    A layer without `self_attn` (linear attention: a fixed-size state) adds none; one whose attention
    stays whole (None) keeps every key/value head.
    """
    config = model.config.get_text_config()
    total = 0
    for layer, heads in zip(model.model.layers, split):
        modules = attention_modules(layer.self_attn) if hasattr(layer, "self_attn") else []
        total += sum(_attention_bytes(attn, heads, config, rank) for attn in modules)
    return total * element_size


def _attention_bytes(attn: nn.Module, heads: AttentionSplit | None, config, rank: int) -> int:
    """Values of KV cache one token adds to one attention module on `rank` (and its indexer's keys)."""
    if is_mla(attn):  # the latent, whole on every rank (transformers' own forward caches it too)
        values = config.kv_lora_rank + config.qk_rope_head_dim
    elif heads is None:  # every key/value head (configs that leave them out mean one per query head)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(attn, "head_dim", None) or config.hidden_size // config.num_attention_heads
        values = 2 * kv_heads * head_dim
    else:
        values = 2 * len(heads.shares[rank].kv_heads) * heads.head_dim
    indexer = getattr(attn, "indexer", None)
    return values + (indexer.head_dim if indexer is not None else 0)


def _scaled(heads: range, width: int) -> range:
    return range(heads.start * width, heads.stop * width)


def _kv_pieces(share: HeadShare, head_dim: int) -> tuple[range, ...]:
    """The rows of the KV heads `share` stores, consecutive heads merged into one range."""
    pieces: list[range] = []
    for head in share.kv_heads:
        rows = range(head * head_dim, (head + 1) * head_dim)
        if pieces and pieces[-1].stop == rows.start:
            pieces[-1] = range(pieces[-1].start, rows.stop)
        else:
            pieces.append(rows)
    return tuple(pieces)
