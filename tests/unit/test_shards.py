"""Local shard shapes computed from DTensor metadata alone."""

from torch.distributed.tensor import Replicate, Shard

from shardbook.rankd.shards import local_shape


def test_even_and_uneven_shards_like_torch_chunk():
    assert local_shape((8, 4), [0], (2,), [Shard(0)]) == (4, 4)
    assert local_shape((7, 4), [1], (2,), [Shard(0)]) == (3, 4)
    assert local_shape((2, 4), [3], (4,), [Shard(0)]) == (0, 4)


def test_hsdp_replicates_then_shards():
    assert local_shape((8, 4), [1, 0], (2, 2), [Replicate(), Shard(0)]) == (4, 4)
    assert local_shape((8, 4), [0, 1], (2, 2), [Shard(1), Shard(0)]) == (4, 2)
