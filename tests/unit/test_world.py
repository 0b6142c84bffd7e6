"""Device and backend selection with the device functions faked (no NPU or GPU here)."""

from __future__ import annotations

import pytest

from shardbook.rankd.control.world import BACKEND_FOR_DEVICE, DeviceProbe, JobShape, detect_device, device_for_rank


def probe(npu: int = 0, cuda: int = 0) -> DeviceProbe:
    return DeviceProbe(npu_count=lambda: npu, cuda_count=lambda: cuda)


@pytest.mark.parametrize("npu, cuda, expected", [(8, 0, "npu"), (8, 4, "npu"), (0, 4, "cuda"), (0, 0, "cpu")])
def test_auto_prefers_npu_then_cuda_then_cpu(npu, cuda, expected):
    assert detect_device("auto", probe(npu, cuda)) == expected


def test_explicit_device_overrides_detection():
    assert detect_device("cpu", probe(8, 8)) == "cpu"
    assert detect_device("cuda", probe(8, 2)) == "cuda"


def test_requesting_an_absent_device_is_an_error():
    with pytest.raises(ValueError, match="device 'npu' was requested but none is available"):
        detect_device("npu", probe(0, 2))


def test_unknown_device_name():
    with pytest.raises(ValueError, match="choose one of auto, cpu, cuda, npu"):
        detect_device("tpu", probe())


def test_each_rank_on_its_local_rank_device():
    assert device_for_rank("npu", 3, probe(npu=8)) == "npu:3"
    assert device_for_rank("cuda", 1, probe(cuda=2)) == "cuda:1"
    assert device_for_rank("cpu", 5, probe()) == "cpu"
    with pytest.raises(ValueError, match="local rank 2 needs cuda:2 but this node has 2"):
        device_for_rank("cuda", 2, probe(cuda=2))


def test_backends():
    assert BACKEND_FOR_DEVICE["cpu"] == "gloo"
    assert "hccl" in BACKEND_FOR_DEVICE["npu"] and "nccl" in BACKEND_FOR_DEVICE["cuda"]


def test_job_shape_from_torchrun_environment():
    shape = JobShape.from_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"})
    assert (shape.rank, shape.world_size, shape.local_rank, shape.under_torchrun, shape.single_node) == (
        3,
        8,
        1,
        True,
        False,
    )
    assert JobShape.from_env({}) == JobShape()
    assert JobShape().single_node


def test_load_device_is_the_ranks_own_or_cpu():
    from shardbook.rankd.control.world import World, load_device

    world = World(shape=JobShape(), device_type="cuda", device="cuda:1", backend="cuda:nccl,cpu:gloo")
    assert load_device("auto", world) == "cuda:1"
    assert load_device("cuda", world) == "cuda:1"
    assert load_device("cpu", world) == "cpu"
    with pytest.raises(ValueError, match="SHARDBOOK_DEVICE=npu"):
        load_device("npu", world)
