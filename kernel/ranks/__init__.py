"""Rank 0's hold on the ranks: the `Pool` (commands out, messages back, stops, liveness), the process-wide
`Runtime`, the generation queue every user of the ranks waits in, and per-rank failures grouped.

May import `rankd`; nothing else in `kernel`.
"""
