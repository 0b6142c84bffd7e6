"""How a model is laid out over the ranks: the device mesh and FSDP2 (`layout`), the `tp` forward
(`tensor_parallel`, built from `tp_modules` and `head_split`), experts (`expert_parallel`), whole tensors from
every rank's pieces (`wholes`) and the `%shards` table (`shard_table`).

May import `rankd.control` and `rankd.config`; knows nothing of checkpoints, generation or inspection.
"""
