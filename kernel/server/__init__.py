"""The OpenAI-compatible HTTP server on rank 0: its options, security checks and thread (`server`), the handlers
(`completions`) and the protocol's shapes (`openai_api`).

May import `rankd`, `kernel.ranks` and `kernel.api`.
"""
