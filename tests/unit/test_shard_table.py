"""Local shard shapes computed from DTensor metadata alone."""

from torch.distributed.tensor import Replicate, Shard

from shardbook.rankd.parallel.shard_table import local_shape


def test_even_and_uneven_shards_like_torch_chunk():
    assert local_shape((8, 4), [0], (2,), [Shard(0)]) == (4, 4)
    assert local_shape((7, 4), [1], (2,), [Shard(0)]) == (3, 4)
    assert local_shape((2, 4), [3], (4,), [Shard(0)]) == (0, 4)


def test_hsdp_replicates_then_shards():
    assert local_shape((8, 4), [1, 0], (2, 2), [Replicate(), Shard(0)]) == (4, 4)
    assert local_shape((8, 4), [0, 1], (2, 2), [Shard(1), Shard(0)]) == (4, 2)


def test_chunk_rows_are_torch_chunks():
    """Loading and %shards split dim 0 as FSDP2 does, which is torch.chunk's split padded to one chunk size."""
    import torch

    from shardbook.rankd.parallel.layout import chunk_rows

    for total in range(12):
        for parts in range(1, 6):
            chunks = torch.arange(total).chunk(parts) if total else ()
            for index in range(parts):
                rows, size = chunk_rows(total, parts, index)
                expected = chunks[index].tolist() if index < len(chunks) else []
                assert list(rows) == expected and size == -(-total // parts), (total, parts, index)
