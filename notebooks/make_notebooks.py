"""Write the example notebooks (quickstart.ipynb, inspect.ipynb, tools.ipynb) from the cells listed here.

The notebooks are generated, never edited by hand: change a cell here and run

    python notebooks/make_notebooks.py

Both are saved unexecuted, on the ``shardbook-2`` kernel, with stable cell ids so that a
regeneration without changes leaves them byte for byte the same. They run with their folder
as working directory (Jupyter's rule, and ``shardbook run``'s), hence ``../configs/...``.
Run one headless with ``shardbook run notebooks/quickstart.ipynb --nproc 2``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook

HERE = Path(__file__).resolve().parent
KERNELSPEC = {"name": "shardbook-2", "display_name": "shardbook (2 ranks, 1 node)", "language": "python"}
CONFIG = "../configs/smollm2-135m.yaml"


def md(text: str) -> tuple[str, str]:
    return ("markdown", text.strip("\n"))


def code(text: str) -> tuple[str, str]:
    return ("code", text.strip("\n"))


QUICKSTART = [
    md("""
# Quickstart: a sharded SmolLM2 in Jupyter

This notebook runs on a **shardbook** kernel: rank 0 of a `torchrun` job is the kernel you type
into, and the other ranks follow it. The model is split across the ranks with FSDP2, so no rank
ever holds all of its weights.

Install a 2-rank kernel once and pick *shardbook (2 ranks, 1 node)* in Jupyter:

    shardbook install --user --nproc 2
    shardbook fetch smollm2-135m-instruct   # the demo model, once

or run the whole notebook headless, printing every output as it comes:

    shardbook run notebooks/quickstart.ipynb --nproc 2
"""),
    md("`%dist` lists the ranks of the job: host, process, device, backend, state and memory."),
    code("%dist"),
    md("""
## Load the model on every rank

`%load_sharded` reads a YAML config (any key can be overridden, e.g.
`--inference.max_new_tokens 64`) and loads the checkpoint on every rank at once: each rank reads
only its own slices of the safetensors files. Afterwards `model` and `tokenizer` exist in every
rank's namespace. The path is relative to this notebook's folder.
"""),
    code(f"%load_sharded {CONFIG}"),
    md("""
`%shards PREFIX` shows where each parameter lives: its full (global) shape, how it is placed
(`S(0)`: split along dimension 0) and the shape of the piece each rank holds. Here, the first
decoder layer:
"""),
    code("%shards model.layers.0"),
    md("""
The same facts from the ranks themselves: `%%all` runs a cell on every rank, and each rank prints
the shape of its *local* shard of a weight matrix (an FSDP2 parameter is a `DTensor`;
`to_local()` is the rank's own piece).
"""),
    code("""
%%all
import torch.distributed as dist

weight = model.model.layers[0].self_attn.q_proj.weight
print(f"rank {dist.get_rank()}: q_proj global {tuple(weight.shape)}, "
      f"local shard {tuple(weight.to_local().shape)}, placements {weight.placements}")
"""),
    md("""
## Chat

`%%chat` sends the cell to the model and streams the reply live into the notebook; every rank
takes part in each step of generation. When the reply is complete it is also shown as text, so a
saved or converted notebook keeps it.
"""),
    code("""
%%chat --max-new-tokens 48
What is the capital of France?
"""),
    md("""
Later `%%chat` cells continue the same conversation (`--new` starts over; `%chat --history`
shows it). `_chat` holds the last reply and its measurements.
"""),
    code("""
%%chat --max-new-tokens 64
What is it famous for?
"""),
    code("""
print(f"{_chat.prompt_tokens} prompt tokens -> {_chat.generated_tokens} generated ({_chat.finish_reason}); "
      f"first token after {_chat.time_to_first_token_s:.2f} s, {_chat.tokens_per_s:.1f} tokens/s")
"""),
    md("""
## Sampling

Greedy decoding (the default in the config) gives the same reply every time. `--do-sample`
samples instead; rank 0 sends the seed to every rank, so all ranks draw the same tokens, and a
fixed `--seed` makes the reply reproducible.
"""),
    code("""
%%chat --new --do-sample --seed 1 --temperature 0.8 --max-new-tokens 64
Suggest a name for a friendly robot, and say why in one sentence.
"""),
    code("%chat --history"),
]

INSPECT = [
    md("""
# Inspecting a sharded model

A researcher's session on a **shardbook** kernel (2 ranks): look inside SmolLM2 while it runs
sharded, with tools that give rank 0 whole tensors whatever the forward layout (`gather`,
`reshard` or `tp`). A logit lens, an activation-patching experiment between two prompts, a
steering vector that changes a chat reply, and a histogram of one weight matrix.

Run it in Jupyter on *shardbook (2 ranks, 1 node)*, or headless:

    shardbook run notebooks/inspect.ipynb --nproc 2
"""),
    code(f"%load_sharded {CONFIG}"),
    md("""
## The logit lens

`%logit_lens` runs the prompt once on every rank and projects each layer's residual stream
through the final norm and the unembedding: what would the model say if it stopped at that
layer? Each cell shows the top next token at that position and layer, coloured by its
probability. The early layers mostly echo their input; the answer appears in the last ones.
"""),
    code("%logit_lens The capital of France is"),
    md("`_lens` keeps the table: the top tokens and their probabilities for every layer and position."),
    code("""
last = [row for row in _lens.rows if row["position"] == len(_lens.lens.tokens[0]) - 1]
for row in last[::6] + last[-1:]:
    print(f"{row['layer']:>16}: {row['top_tokens'][0]!r:>10} p={row['top_probs'][0]:.2f}")
"""),
    md("""
## Activation patching

Two prompts that differ in one token. `%%trace` captures every decoder layer's output (the
residual stream) on rank 0, as whole tensors on CPU, plus the logits.
"""),
    code("""
%%trace --as clean
The capital of France is
"""),
    code("""
%%trace --as corrupt
The capital of Italy is
"""),
    code("""
import torch

paris = tokenizer(" Paris")["input_ids"][0]


def p_paris(trace):
    return torch.softmax(trace.logits[-1], -1)[paris].item()


print(f"P(' Paris'): clean {p_paris(clean):.3f}, corrupt {p_paris(corrupt):.3f}")
"""),
    md("""
Now run the corrupt prompt again, but at one layer put back the clean residual stream at the
country's position, and see how much of the answer comes back. The patch is an *intervention*: a
function defined on every rank with `%%all` (so no code travels over the network) and then
registered by name with `%intervene`. It sees the whole tensor under every layout. `%share`
copies rank 0's `clean` trace to every rank first.
"""),
    code("%share clean"),
    code("""
%%all
country = next(i for i, (a, b) in enumerate(zip(tokenizer("The capital of France is")["input_ids"],
                                               tokenizer("The capital of Italy is")["input_ids"])) if a != b)


def patch(output, module_name):
    output[:, country] = clean[module_name][:, country].to(output.dtype)
"""),
    code("""
recovered = []
for layer in range(len(clean)):
    %intervene --quiet patch model.layers.{layer}
    patched = %trace The capital of Italy is --modules model.layers.0
    recovered.append(p_paris(patched))
%intervene --clear
"""),
    code("""
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(8, 3))
ax.plot(recovered, marker="o")
ax.axhline(p_paris(clean), color="green", linestyle="--", label="clean")
ax.axhline(p_paris(corrupt), color="red", linestyle="--", label="corrupt")
ax.set(xlabel="layer patched (clean stream at the country's position)", ylabel="P(' Paris')",
       title="Where does the model read the country?")
ax.legend()
plt.show()
"""),
    md("""
Patching the country's position brings the answer back when done early, and stops helping
after a certain layer (about layer 22 for SmolLM2): by then the later positions have already
read the country from there, so the corrupt reading has moved on with them.

`%patch` does the whole sweep in one command, for every layer *and* every position: the metric
is a function of the logits defined on every rank, and the table comes back with a heatmap.
`--method attribution` estimates the same table from one forward and one backward (gradients
flow through the sharded model under every layout).
"""),
    code("""
%%all
paris_id, rome_id = tokenizer(" Paris")["input_ids"][0], tokenizer(" Rome")["input_ids"][0]


def paris_vs_rome(logits):
    return logits[0, -1, paris_id] - logits[0, -1, rome_id]
"""),
    code("""
clean_prompt, corrupt_prompt = "The capital of France is", "The capital of Italy is"
%patch --clean clean_prompt --corrupt corrupt_prompt --modules model.layers.* --metric paris_vs_rome
"""),
    code("""
%patch --method attribution --clean clean_prompt --corrupt corrupt_prompt --modules model.layers.* --metric\
 paris_vs_rome
"""),
    md("""
## A steering vector

The difference between the residual streams of two kinds of prompts at a middle layer is a
direction in the model's space; adding it during generation pushes the reply that way. First the
reply without it:
"""),
    code("""
%%chat --new --max-new-tokens 32
Describe your ideal weekend in one sentence.
"""),
    md("""
The direction comes from 32 pairs of prompts, traced in batches with `--reduce mean`: each rank
averages layer 12's output over every token of every prompt as the batches go, and only the
averaged vector reaches rank 0.
"""),
    code("""
topics = ["this", "my job", "the weather", "the food", "my friends", "this city", "the music", "my home",
          "the weekend", "this book", "the news", "my school", "the garden", "this game", "the trip", "my car",
          "the movie", "the beach", "my neighbours", "this song", "the coffee", "the park", "my family", "the show",
          "the winter", "this phone", "the team", "my bike", "the market", "this café", "the river", "my week"]
happy_prompts = [f"I love {t}, it is wonderful and I am so happy" for t in topics]
sad_prompts = [f"I hate {t}, it is terrible and I am so sad" for t in topics]
layer = "model.layers.12"
happy = %trace --prompts happy_prompts --modules {layer} --reduce mean --batch-size 16
sad = %trace --prompts sad_prompts --modules {layer} --reduce mean --batch-size 16
steer = 2 * (happy[layer] - sad[layer])
print(f"steering vector of norm {steer.norm():.1f} at {layer}, from {happy.prompts} + {sad.prompts} prompts "
      f"({happy.tokens} + {sad.tokens} tokens)")
"""),
    code("%share steer"),
    code("""
%%all
def add_steer(output, module_name):
    return output + steer.to(output.dtype)
"""),
    code("%intervene add_steer model.layers.12"),
    md("The same question, with the vector added at layer 12 on every rank, for every generated token:"),
    code("""
%%chat --new --max-new-tokens 32
Describe your ideal weekend in one sentence.
"""),
    code("%intervene --remove add_steer"),
    md("""
## How sure was the model?

`%%chat --scores` colours each generated token by its probability (hover for the alternatives)
and keeps the numbers in `_chat.scores`.
"""),
    code("""
%%chat --new --scores --max-new-tokens 24
What is the capital of France?
"""),
    code("""
for step in sorted(_chat.scores, key=lambda s: s["prob"])[:3]:
    best_other = max((a for a in step["alternatives"] if a["token_id"] != step["token_id"]), key=lambda a: a["prob"])
    print(f"{step['text']!r:>14} p={step['prob']:.3f}   runner-up {best_other['text']!r} p={best_other['prob']:.3f}")
"""),
    md("""
## A weight matrix, whole

`full_parameter` (or `%param NAME`, with Tab completion of the name) gathers a parameter's
shards onto rank 0, under every layout, within a size limit.
"""),
    code("""
w = full_parameter("model.layers.0.mlp.down_proj.weight")
fig, ax = plt.subplots(figsize=(6, 3))
ax.hist(w.flatten().float().numpy(), bins=200, log=True)  # numpy has no bfloat16
ax.set(title=f"model.layers.0.mlp.down_proj.weight {tuple(w.shape)}", xlabel="value", ylabel="count")
plt.show()
"""),
]

TOOL_FUNCTIONS = '''
def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first
        b: the second
    """
    return a + b


def halve(x: float) -> float:
    """Half of a number.

    Args:
        x: the number
    """
    return x / 2


tools = [add, halve]
'''
"""The tools of notebooks/tools.ipynb (also the ones tests/e2e/test_chat_tools.py's taught model calls)."""

TOOLS = [
    md("""
# A tool loop, step by step

`%%chat --tools NAME` lets the model call the Python functions of the list `NAME`: each call runs here on
rank 0, its result goes back to the model, and the model is asked again until it answers. Every step is shown
and kept in `_chat.steps`, and each step's prompt is an ordinary prompt: trace it, intervene on it, patch it.

This needs a model that calls tools (Qwen3, GLM-4.5/5, DeepSeek-V3.1, Kimi-K2, MiniMax-M2, gpt-oss; the demo
SmolLM2 has no tool format). Point `SHARDBOOK_TOOLS_MODEL` at its checkpoint directory, then run

    SHARDBOOK_TOOLS_MODEL=/path/to/Qwen3-0.6B shardbook run notebooks/tools.ipynb --nproc 2

(the test suite runs it on a tiny model it teaches to make these very calls).
"""),
    code("""
import os

MODEL = os.environ.get("SHARDBOOK_TOOLS_MODEL", os.path.expanduser("~/models/Qwen3-0.6B"))
"""),
    code("%load_sharded " + CONFIG + " --model.model_name_or_path {MODEL} --inference.system_prompt none"),
    md("Tools are plain functions with type hints and a docstring: their JSON schemas are read from both."),
    code(TOOL_FUNCTIONS),
    code("""
%%chat --tools tools --max-new-tokens 64
Add 2 and 3, then halve it.
"""),
    md("Each step: the call, its arguments, what the model was told back, and the prompt that led to it."),
    code("""
for step in _chat.steps:
    print(step.describe())
print("answer:", _chat.text)
"""),
    md("""
## Trace a step

The second step's prompt holds the question, the first call and its result. Traced, the model's most likely
next token there is the start of the call it made.
"""),
    code("""
step_prompts = [s.prompt for s in _chat.steps]
traces = %trace --prompts step_prompts --modules model.layers.*
print(step_prompts[1])
print("next token:", repr(tokenizer.decode([int(traces[1].logits[-1].argmax())])))
"""),
    code("%chat --history"),
]


def build(cells: list[tuple[str, str]], stem: str):
    """A notebook of `cells` on the shardbook-2 kernel, with ids ``STEM-NN``."""
    made = []
    for index, (kind, source) in enumerate(cells):
        cell = new_markdown_cell(source) if kind == "markdown" else new_code_cell(source)
        cell.id = f"{stem}-{index:02d}"
        made.append(cell)
    nb = new_notebook(cells=made, metadata={"kernelspec": KERNELSPEC, "language_info": {"name": "python"}})
    nbformat.validate(nb)
    return nb


NOTEBOOKS = {"quickstart": QUICKSTART, "inspect": INSPECT, "tools": TOOLS}


def main(out_dir: Path = HERE) -> list[Path]:
    written = []
    for stem, cells in NOTEBOOKS.items():
        path = out_dir / f"{stem}.ipynb"
        nbformat.write(build(cells, stem), path)
        written.append(path)
    return written


if __name__ == "__main__":
    for path in main(Path(sys.argv[1]) if len(sys.argv) > 1 else HERE):
        print(f"wrote {path}")
