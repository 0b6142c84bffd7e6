"""Looking inside the loaded model: traces of chosen modules, whole on rank 0 under every layout (`tracing`), and
interventions, a user's function applied in every forward on every rank (`interventions`).

May import every layer below it, `generation` included (a trace builds its prompt as a chat turn does).
"""
