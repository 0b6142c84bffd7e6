"""shardbook.rankd: what every rank runs, rank 0 included; nothing here imports IPython's display or ipywidgets.

Layers, lowest first; a module imports only from its own layer or those below it:

- `control`: the world (devices, process group), the control plane (protocol, channel, heartbeats), the command
  table and the follower loop, running a cell with its output captured.
- `config`: the config's schema, YAML and `--section.key` overrides, the generated reference.
- `parallel`: how a model is laid out over the ranks: FSDP2, the `tp` forward, experts, whole tensors from pieces.
- `loading`: a sharded load: checks, reading each rank's slices from safetensors, replacing the model held now.
- `generation`: the engine every rank steps through to produce a reply, and token-to-text streaming.
- `inspection`: traces and interventions over the loaded model.
- `commands`: the handlers rank 0 calls by name; the entry points import them, nothing else does.

`python -m shardbook.rankd` starts a follower rank (`__main__`).
"""
