"""The commands a rank runs for rank 0, one module per kind: loading (`load`, `reshard`), `generate`, and inspection
(`trace`, `full_parameter`, `intervene`, `share`); importing this package registers them in the control plane's
table (`shardbook.rankd.control.dispatch`), next to the control plane's own commands.

A handler reads its arguments, calls into the layer that does the work and replies; it may import every other
part of `rankd`, and nothing imports it but the entry points (the follower's `__main__`, rank 0's pool). The
heavy layers (torch, transformers) are imported inside the handlers, so a rank starts without them.
"""

from shardbook.rankd.commands import generate, inspect, load

__all__ = ["generate", "inspect", "load"]
