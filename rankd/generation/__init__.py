"""Producing replies: the engine every rank steps through together (`engine`) and token-to-text streaming
(`streaming`).

May import `control`, `config`, `parallel` and `loading`.
"""
