"""How the magics show things: the streamed reply, the logit lens, load and shard tables, the `%dist` table and
progress. Rendering only: no rank is contacted from here.

May import `kernel` (progress text); nothing else in `magics`.
"""
