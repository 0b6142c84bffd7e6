"""Skip tests marked for hardware this machine does not have."""

from __future__ import annotations

import pytest


def _has(kind: str) -> bool:
    from shardbook.rankd.control.world import DeviceProbe

    probe = DeviceProbe.real()
    return (probe.cuda_count if kind == "gpu" else probe.npu_count)() > 0


def pytest_collection_modifyitems(config, items):
    for kind in ("gpu", "npu"):
        marked = [item for item in items if kind in item.keywords]
        if marked and not _has(kind):
            skip = pytest.mark.skip(reason=f"needs a {kind.upper()}; none on this machine")
            for item in marked:
                item.add_marker(skip)
