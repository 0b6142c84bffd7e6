"""shardbook.kernel: the rank-0 side — kernel app, kernelspec, Pool, ChatModel, command line.

``ChatModel`` is imported lazily: every rank imports this package at start-up and should not
pay for transformers before it needs it.
"""


def __getattr__(name: str):
    if name in ("ChatModel", "ChatResponse"):
        from . import chat

        return getattr(chat, name)
    raise AttributeError(f"module 'shardbook.kernel' has no attribute {name!r}")
