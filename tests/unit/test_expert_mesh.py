"""The expert mesh (edp, efsdp, ep), EP innermost, for the flagship layout: 32 ranks, ep_size 16, ep_fsdp_size 2.

Built on torch's fake process group (one process plays every rank, no communication), so the
rank groups `layout.expert_group` makes can be read for any rank of a large job.
"""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore

from shardbook.rankd.parallel.expert_parallel import ExpertLayout


@pytest.fixture
def fake_world():
    def start(rank: int, world_size: int) -> None:
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)

    yield start
    if dist.is_initialized():
        dist.destroy_process_group()


def test_flagship_layout_positions():
    """ep 16 x ep_fsdp 2 on a 32-rank group: ranks 0-15 (node 0) hold different experts, r and r + 16 split each."""
    layout = ExpertLayout.of(32, 16, 2)
    assert layout.set_size == 32 and "mesh (edp=1, efsdp=2, ep=16)" in layout.describe()
    assert [layout.position(r) for r in (0, 1, 15, 16, 17, 31)] == [(0, 0), (1, 0), (15, 0), (0, 1), (1, 1), (15, 1)]


def test_seed_command_layout_positions():
    """The seed's `--parallel.fsdp_size 16 --parallel.ep_size 8 --parallel.ep_fsdp_size 2`: two 16-rank groups."""
    layout = ExpertLayout.of(16, 8, 2)
    assert layout.set_size == 16 and [layout.position(r) for r in (0, 7, 8, 15)] == [(0, 0), (7, 0), (0, 1), (7, 1)]


def test_defaults_split_each_expert_over_the_whole_group():
    assert ExpertLayout.of(4, 1, 1) == ExpertLayout(parts=4, ep=1, efsdp=4)


@pytest.mark.parametrize("rank", [0, 21])
def test_the_expert_group_comes_from_a_mesh_made_once(fake_world, rank):
    from shardbook.rankd.parallel.layout import expert_group

    fake_world(rank, 32)
    group = expert_group("cpu", 16, 32, dist.group.WORLD)
    first = rank // 16 * 16
    assert dist.get_process_group_ranks(group) == list(range(first, first + 16))
    groups = len(dist.distributed_c10d._world.pg_map)
    assert expert_group("cpu", 16, 32, dist.group.WORLD) is group  # a second load reuses the mesh's groups
    assert len(dist.distributed_c10d._world.pg_map) == groups
    assert expert_group("cpu", 32, 32, dist.group.WORLD) is dist.group.WORLD
