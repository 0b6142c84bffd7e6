"""The OpenAI-compatible HTTP server on rank 0: its options and thread (`server`), who may ask (`access`: the
API key, Host, Origin and Content-Type), the handlers (`completions`) and the protocol's shapes (`openai_api`).

May import `rankd`, `kernel.ranks` and `kernel.api`.
"""
