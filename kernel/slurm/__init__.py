"""Slurm: allocate nodes, start every rank in one ``srun`` step, give the nodes back.

May import ``kernel.ranks``, ``kernel.api``, ``kernel.server`` and ``rankd``; ``kernel.cli`` imports it
(``shardbook install --slurm``, ``shardbook serve --slurm``). The Jupyter kernel provisioner is
:class:`shardbook.kernel.slurm.provisioner.SlurmProvisioner`; every node runs
``python -m shardbook.kernel.slurm.node``.
"""
