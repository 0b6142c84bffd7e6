"""The `shardbook` command line (`main`): the kernelspec and `install`, `run`, the terminal `chat` and `serve`, and
the launcher that starts their torchrun job.

May import every other part of `kernel`, and `rankd`.
"""
