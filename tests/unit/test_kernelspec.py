"""The kernelspec shardbook installs."""

from __future__ import annotations

import json
import sys

import pytest

from shardbook.kernel.cli import kernelspec
from shardbook.kernel.cli import main as cli
from shardbook.rankd.control.protocol import KEY_FILE_ENV


def spec(**layout):
    return kernelspec.kernelspec_dict(kernelspec.KernelSpecOptions(kernelspec.Layout(**layout)))


def test_single_node_argv_is_the_local_launcher():
    d = spec(nproc=4)
    assert d["argv"][:5] == [sys.executable, "-m", "shardbook.kernel.cli.localrun", "--nproc", "4"]
    assert d["argv"][-4:] == ["-m", "shardbook.kernel", "-f", "{connection_file}"]
    assert d["interrupt_mode"] == "message"
    assert "4 ranks" in d["display_name"]


def test_multi_node_argv_carries_the_rendezvous():
    d = spec(nproc=8, nnodes=2, master_addr="10.0.0.1", master_port=29500)
    argv = d["argv"]
    assert argv[1:3] == ["-m", "torch.distributed.run"]
    for flag, value in [
        ("--nnodes", "2"),
        ("--node_rank", "0"),
        ("--master_addr", "10.0.0.1"),
        ("--master_port", "29500"),
    ]:
        assert argv[argv.index(flag) + 1] == value
    assert "16 ranks" in d["display_name"]


@pytest.mark.parametrize(
    "layout, message",
    [
        (dict(nproc=0), "at least 1"),
        (dict(nproc=2, nnodes=2, node_rank=1, master_addr="h", master_port=1), "node-rank 0"),
        (dict(nproc=2, nnodes=2), "--master-addr"),
    ],
)
def test_bad_layouts(layout, message):
    with pytest.raises(ValueError, match=message):
        kernelspec.Layout(**layout)


def test_install_list_uninstall(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    assert (
        cli.main(["install", "--nproc", "2", "--prefix", str(tmp_path), "--env", "A=1", "--display-name", "Two"]) == 0
    )
    written = json.loads((tmp_path / "share/jupyter/kernels/shardbook-2/kernel.json").read_text())
    assert written["env"] == {"A": "1"} and written["display_name"] == "Two"
    cli.main(["list"])
    assert "shardbook-2" in capsys.readouterr().out
    monkeypatch.setenv("JUPYTER_DATA_DIR", str(tmp_path / "share" / "jupyter"))
    assert cli.main(["uninstall", "shardbook-2"]) == 0
    assert cli.main(["uninstall", "shardbook-2"]) == 1


def test_multi_node_install_creates_a_private_key_file(tmp_path):
    key = tmp_path / "job.key"
    argv = [
        "install",
        "--nproc",
        "1",
        "--nnodes",
        "2",
        "--master-addr",
        "127.0.0.1",
        "--master-port",
        "29555",
        "--key-file",
        str(key),
        "--prefix",
        str(tmp_path),
        "--name",
        "mn",
    ]
    assert cli.main(argv) == 0
    assert len(key.read_text().strip()) == 64 and (key.stat().st_mode & 0o777) == 0o600
    written = json.loads((tmp_path / "share/jupyter/kernels/mn/kernel.json").read_text())
    assert written["env"][KEY_FILE_ENV] == str(key)


def test_bad_env_item_is_an_error(tmp_path):
    with pytest.raises(SystemExit) as e:
        cli.main(["install", "--nproc", "1", "--prefix", str(tmp_path), "--env", "NOEQUALS"])
    assert e.value.code == 2
