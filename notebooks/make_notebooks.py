"""Write the example notebooks (quickstart.ipynb, inspect.ipynb) from the cells listed here.

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
    md(f"""
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

A researcher's session on a **shardbook** kernel (2 ranks): look inside the model while it runs
sharded. Forward hooks go on every rank with `%%all`, their records are gathered to rank 0 with
`torch.distributed`, and rank 0 plots them. Then `%%chat --scores` shows how sure the model was
of each token it wrote.

Run it in Jupyter on *shardbook (2 ranks, 1 node)*, or headless:

    shardbook run notebooks/inspect.ipynb --nproc 2
"""),
    code(f"%load_sharded {CONFIG}"),
    md("""
## Hooks on every rank

A forward hook on each decoder layer records the mean and standard deviation of the layer's
output (the residual stream after that layer). The hooks must be registered on every rank: each
rank runs its own copy of the forward pass, FSDP2 gathering each layer's weights just in time.
"""),
    code("""
%%all
import torch
import torch.distributed as dist

rank, world = dist.get_rank(), dist.get_world_size()
layer_stats = {}  # layer index -> (mean, std) of that layer's output in the last forward pass


def record(index):
    def hook(module, args, output):
        hidden = (output[0] if isinstance(output, tuple) else output).detach().float()
        layer_stats[index] = (hidden.mean().item(), hidden.std().item())
    return hook


hooks = [layer.register_forward_hook(record(i)) for i, layer in enumerate(model.model.layers)]
print(f"rank {rank}: {len(hooks)} hooks registered")
"""),
    md("One forward pass on every rank, on the same sentence (the ranks shard the weights, not the data):"),
    code("""
%%all
prompt = "The capital of France is Paris. The capital of Germany is"
inputs = tokenizer(prompt, return_tensors="pt").to(model.device)
with torch.no_grad():
    logits = model(**inputs).logits
next_token = tokenizer.decode(logits[0, -1].argmax())
print(f"rank {rank}: {len(layer_stats)} layers recorded; next token {next_token!r}")
"""),
    md("""
## Gather to rank 0

`gather_object` collects every rank's records on rank 0, inside `%%all` since every rank must
take part in a collective. FSDP2 splits the parameters, yet every rank computes the full
activations of its own input, so the records agree across ranks.
"""),
    code("""
%%all
gathered = [None] * world if rank == 0 else None
dist.gather_object(layer_stats, gathered, dst=0)
if rank == 0:
    per_rank_stats = gathered
    agree = all(stats == gathered[0] for stats in gathered)
    print(f"gathered {len(gathered)} ranks x {len(gathered[0])} layers; identical on every rank: {agree}")
for hook in hooks:
    hook.remove()
"""),
    md("""
A plain cell runs on rank 0 alone, whose namespace now holds `per_rank_stats`. The ranks' curves
lie on top of each other. Look for layers where the spread jumps by orders of magnitude: a few
very large activations there dominate the std of the whole residual stream.
"""),
    code("""
import matplotlib.pyplot as plt

layers = sorted(per_rank_stats[0])
fig, (ax_std, ax_mean) = plt.subplots(1, 2, figsize=(11, 3.5))
for r, stats in enumerate(per_rank_stats):
    style = dict(marker="o" if r == 0 else "x", linestyle="-" if r == 0 else "--", label=f"rank {r}")
    ax_std.plot(layers, [stats[i][1] for i in layers], **style)
    ax_mean.plot(layers, [stats[i][0] for i in layers], **style)
ax_std.set(title="std of each decoder layer's output", xlabel="layer", ylabel="std", yscale="log")
ax_mean.set(title="mean of each decoder layer's output", xlabel="layer", ylabel="mean")
ax_std.legend()
fig.tight_layout()
plt.show()
"""),
    md("""
## How sure was the model?

`%%chat --scores` records, for each generated token, its probability and the most likely
alternatives at that step (`_chat.scores`).
"""),
    code("""
%%chat --scores --max-new-tokens 24
What is the capital of France?
"""),
    code("""
import html
from IPython.display import HTML


def token(step):  # the end-of-turn token decodes to nothing: show its name instead
    text = step["text"] or tokenizer.convert_ids_to_tokens(step["token_id"])
    return html.escape(repr(text)[1:-1])


def alternatives(step):
    others = [a for a in step["alternatives"] if a["token_id"] != step["token_id"]][:3]
    return ", ".join(f"<code>{token(a)}</code> {a['prob']:.3f}" for a in others)


rows = [
    f"<tr><td><code>{token(step)}</code></td><td>{step['prob']:.3f}</td><td>{alternatives(step)}</td></tr>"
    for step in _chat.scores
]
HTML("<table><thead><tr><th>token</th><th>probability</th><th>top alternatives</th></tr></thead>"
     f"<tbody>{''.join(rows)}</tbody></table>")
"""),
    md("The least certain steps are where another answer was closest:"),
    code("""
for step in sorted(_chat.scores, key=lambda s: s["prob"])[:3]:
    best_other = max((a for a in step["alternatives"] if a["token_id"] != step["token_id"]), key=lambda a: a["prob"])
    print(f"{step['text']!r:>14} p={step['prob']:.3f}   runner-up {best_other['text']!r} p={best_other['prob']:.3f}")
"""),
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


NOTEBOOKS = {"quickstart": QUICKSTART, "inspect": INSPECT}


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
