"""A sharded load (`%load_sharded`): checks before anything is freed (`preflight`), replacing the model held now
(`reload`), the load itself (`load_sharded`, in steps settled at sync points: `load_steps`), each rank reading
only its slices from safetensors (`weight_reading`, `safetensors_files`, `checkpoint_names`), and the summary.

May import `control`, `config` and `parallel`.
"""
