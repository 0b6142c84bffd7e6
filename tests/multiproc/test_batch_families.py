"""Continuous batching of the families whose cache is more than plain full attention, on two gloo ranks.

Eight greedy requests decoded together under `tp`, and `tp` with experts split (`ep_size` 2), must each equal
the same request decoded alone (float32), as in test_batching.py, and so must a longer prompt joining
running rows and one prefilled in chunks. The prompts are left-padded up to 27 positions.

* GLM-5 (`glm_moe_dsa`) and DeepSeek-V3.2 (`deepseek_v32`): an MLA latent cache and a sparse-attention indexer
  with its own key cache and top-4, fewer than most prompts' positions, so a row whose indexer picked a pad,
  or whose indexer keys were misaligned by a join or a leave, would decode other tokens. The tiny models get 8
  indexer heads instead of 2: the indexer's score is a weighted sum of ReLUs, exactly zero for a key every
  head scores negative, and with 2 heads such exact ties are common; `topk` breaks them by its own internal
  order, which differs between a row alone and the same row left-padded. A real indexer (32 or 64 heads)
  almost never ties; the batch's contract is the solo reply whenever the top-k is well defined.
* Qwen3-Next: a Gated DeltaNet layer, whose convolution and recurrent states are per row and would carry a
  row's padding or another row's tokens if padded or merged wrongly, then gated attention.
* gpt-oss: a sliding window of 6 positions on every other layer, shorter than most prompts, so a row whose
  padding took part of its window would decode other tokens.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from test_batching import PROMPTS, _batch_rank_main, _run, _solo, _specs
from test_engine import Ranks
from tiny import TP_FAMILIES, make_tiny_lm, make_tiny_mla, make_tiny_tp_family, random_biases

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module", params=["glm_moe_dsa", "deepseek_v32", "gpt_oss", "qwen3_next"])
def family_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp(request.param) / "model"
    if request.param == "gpt_oss":  # a window of 6 positions, shorter than most prompts
        return make_tiny_lm(path, family="gpt_oss", init=random_biases, sliding_window=6, **TP_FAMILIES["gpt_oss"])
    if request.param == "qwen3_next":
        return make_tiny_tp_family(path, "qwen3_next")
    return make_tiny_mla(path, request.param, index_n_heads=8)


@pytest.fixture(scope="module", params=["tp", "tp+ep"])
def family_ranks(request: pytest.FixtureRequest, family_path: Path, tmp_path_factory):
    ranks = Ranks(
        family_path, tmp_path_factory.mktemp("ranks"), pg_timeout_s=60, layout=request.param, target=_batch_rank_main
    )
    yield ranks
    ranks.close()


def test_eight_greedy_together_equal_alone(family_ranks: Ranks) -> None:
    specs = _specs()
    together = _run(family_ranks, requests=specs)
    assert together["largest_batch"] == 8
    for spec, got in zip(specs, together["results"]):
        assert got == _solo(family_ranks, spec), spec  # rows leave one by one (max_new_tokens differ)


def test_request_joins_mid_batch(family_ranks: Ranks) -> None:
    """A longer prompt joins two running rows: the batch's cache, indexer keys included, is padded to it."""
    specs = [{**spec, "max_new_tokens": 16, "ignore_eos": True} for spec in _specs()[:2]]
    joining = {"prompt": PROMPTS[2], "max_new_tokens": 12}
    answer = _run(family_ranks, requests=specs, late=[{"after": (0, 1), "request": joining}])
    assert answer["largest_batch"] == 3
    assert answer["late"] == [_solo(family_ranks, joining)]
    assert answer["results"] == [_solo(family_ranks, s) for s in specs]


def test_a_prompt_prefilled_in_chunks_joins(family_ranks: Ranks) -> None:
    """A 29-token prompt under a 12-token step is prefilled in pieces into its own one-row cache, then joins."""
    specs = [{"prompt": p, "max_new_tokens": 8, "ignore_eos": True} for p in (PROMPTS[0], PROMPTS[2])]
    answer = _run(family_ranks, requests=specs, limits={"max_step_tokens": 12})
    assert max(columns for _, columns in answer["forwards"]) <= 12
    assert answer["results"] == [_solo(family_ranks, s) for s in specs]
