"""Outside torchrun: %load_ext shardbook.magics in a plain IPython kernel is a world of one rank."""

from __future__ import annotations

import pytest

from tests.e2e.conftest import KernelHandle

pytestmark = pytest.mark.timeout(120)


def test_plain_ipykernel_is_a_world_of_one(jupyter_prefix):
    handle = KernelHandle("python3")
    try:
        assert handle.run("%load_ext shardbook.magics").status == "ok"
        ex = handle.run("%%all\nimport torch.distributed as dist\nprint('world', dist.get_world_size())\nx = 3")
        assert ex.status == "ok", ex.error_text()
        assert ex.stdout() == "world 1\n"
        assert handle.run("print(x)").stdout() == "3\n"
        table = handle.run("%dist").of_type("execute_result")[0]["content"]["data"]["text/plain"]
        assert len(table.splitlines()) == 2 and table.splitlines()[1].split()[:1] == ["0"]
        bad = handle.run("%%rank 1\nprint(1)")
        assert bad.status == "error" and "this kernel has 1 rank (0-0)" in bad.stderr()
        assert "ZeroDivisionError" in handle.run("%%all\n1/0").error_text()
    finally:
        handle.stop()
