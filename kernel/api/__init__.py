"""Rank 0's Python API over the ranks: `ChatModel` (`chat`), the conversation it keeps, loading (`load`), inspection
(`inspection`), load progress as text, and the demo model store (`fetch`).

May import `rankd` and `kernel.ranks`.
"""
