"""shardbook.kernel: the rank-0 side: the IPython kernel app, and everything rank 0 offers on top of the ranks.

Layers, lowest first; each imports only from `rankd`, its own layer and those below it:

- `ranks`: the `Pool` of ranks (send a command, iterate its messages, stop it, notice dead ranks), rank 0's
  `Runtime`, the generation queue every user of the ranks waits in, per-rank failures grouped.
- `api`: rank 0's Python API: `ChatModel`, conversations, loading, inspection, the demo model store.
- `server`: the OpenAI-compatible HTTP server.
- `cli`: the `shardbook` command line (install, fetch, run, chat, serve) and its torchrun launcher.

`app` (the process every rank of a kernel starts) and `__main__` sit on top.

``ChatModel`` is imported lazily: every rank imports this package at start-up and should not
pay for transformers before it needs it.
"""


def __getattr__(name: str):
    if name in ("ChatModel", "ChatResponse"):
        from shardbook.kernel.api import chat

        return getattr(chat, name)
    raise AttributeError(f"module 'shardbook.kernel' has no attribute {name!r}")
