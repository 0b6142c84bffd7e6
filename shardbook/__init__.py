"""shardbook: sharded LLMs in JupyterLab and the terminal; ``python -m shardbook`` is the ``shardbook`` command."""
