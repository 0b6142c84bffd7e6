"""Continuous batching of the families whose cache is more than plain full attention, on two gloo ranks.

GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`): an MLA latent cache and a sparse-attention indexer
with its own key cache and top-k. Eight greedy requests decoded together under `tp`, and `tp` with experts
split (`ep_size` 2), must each equal the same request decoded alone (float32), as in test_batching.py. The
prompts are longer than the indexer's top-4 and left-padded up to 27 positions, so a row whose indexer picked
a pad, or whose indexer keys were misaligned by a join or a leave, would decode other tokens.

The tiny models get 8 indexer heads instead of 2: the indexer's score is a weighted sum of ReLUs, exactly zero
for a key every head scores negative, and with 2 heads such exact ties are common; `topk` breaks them by its own
internal order, which differs between a row alone and the same row left-padded. A real indexer (32 or 64 heads)
almost never ties; the batch's contract is the solo reply whenever the top-k is well defined.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_batching import PROMPTS, _batch_rank_main, _run, _solo, _specs
from test_engine import Ranks
from tiny import make_tiny_mla

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32"])
def indexed_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_mla(tmp_path_factory.mktemp(request.param) / "model", request.param, index_n_heads=8)


@pytest.fixture(scope="module", params=["tp", "tp+ep"])
def indexed_ranks(request: pytest.FixtureRequest, indexed_path: Path, tmp_path_factory):
    ranks = Ranks(
        indexed_path, tmp_path_factory.mktemp("ranks"), pg_timeout_s=60, layout=request.param, target=_batch_rank_main
    )
    yield ranks
    ranks.close()


def test_eight_greedy_together_equal_alone(indexed_ranks: Ranks) -> None:
    specs = _specs()
    together = _run(indexed_ranks, requests=specs)
    assert together["largest_batch"] == 8
    for spec, got in zip(specs, together["results"]):
        assert got == _solo(indexed_ranks, spec), spec  # rows leave one by one (max_new_tokens differ)


def test_request_joins_mid_batch(indexed_ranks: Ranks) -> None:
    """A longer prompt joins two running rows: the batch's cache, indexer keys included, is padded to it."""
    specs = [{**spec, "max_new_tokens": 16, "ignore_eos": True} for spec in _specs()[:2]]
    joining = {"prompt": PROMPTS[2], "max_new_tokens": 12}
    answer = _run(indexed_ranks, requests=specs, late=[{"after": (0, 1), "request": joining}])
    assert answer["largest_batch"] == 3
    assert answer["late"] == [_solo(indexed_ranks, joining)]
    assert answer["results"] == [_solo(indexed_ranks, s) for s in specs]
