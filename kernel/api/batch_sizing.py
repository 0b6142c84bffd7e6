"""How many sequences the continuous batch decodes together and how many more may wait, when the config leaves
it to shardbook (``inference.max_batch_sequences: null``, no ``--max-waiting``).

The batch takes as many sequences as its KV budget holds at a typical length (a ``TYPICAL_PROMPT_TOKENS``
prompt plus the config's ``max_new_tokens``), capped per device: on a CPU a decode step's time grows with
its rows past a few dozen (64 with bfloat16 kernels, 32 otherwise), so more rows mostly lengthen every stream's
gaps (docs/serving.md, "Batch defaults");
a GPU or an NPU takes as many as vLLM's default (``max_num_seqs`` 256). The waiting line holds one more batch,
and never fewer than ``MIN_WAITING`` requests, so a burst of clients queues instead of being refused.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

TYPICAL_PROMPT_TOKENS = 512
"""The prompt length a sequence is sized for: a chat turn with a system prompt, or a short document."""
CPU_BF16 = "a cpu with bfloat16 kernels"
"""The device kind of a model computing bfloat16 on a CPU with AMX or AVX512-BF16 (`device_kind`)."""
MAX_SEQUENCES = {"cpu": 32, CPU_BF16: 64}
"""The most sequences the sized batch takes on a device kind; `ACCELERATOR_MAX_SEQUENCES` on any other. 64 with
bfloat16 kernels: there 64 clients of the demo model served 1.29x the tokens a second of the 32-row cap, the first
tokens 3.5x sooner (bench/RESULTS.md); in float32, or bf16 without them, 64 rows took 1.5x-1.9x a step of 32."""
ACCELERATOR_MAX_SEQUENCES = 256
MIN_WAITING = 32
"""The fewest requests the waiting line holds when no ``--max-waiting`` is given."""


@dataclass(frozen=True)
class BatchLimits:
    """The batch's size, its waiting line's length, and why (shown by ``%serve`` and ``shardbook serve``)."""

    max_sequences: int
    max_waiting: int
    reason: str

    def describe(self) -> str:
        return f"up to {self.max_sequences} sequences at once, {self.max_waiting} more waiting ({self.reason})"

    def with_waiting(self, max_waiting: int | None) -> BatchLimits:
        """These limits with a server's ``--max-waiting``, when it gave one."""
        if max_waiting is None:
            return self
        return replace(self, max_waiting=max_waiting, reason=f"{self.reason}; the waiting line from --max-waiting")


def device_kind(device_type: str, dtype: str) -> str:
    """The kind `MAX_SEQUENCES` is read for: `device_type`, or `CPU_BF16` for bfloat16 on a CPU with its kernels."""
    if device_type != "cpu" or dtype != "bfloat16":
        return device_type
    from shardbook.rankd.parallel.fastest_dtype import cpu_has_bf16_kernels

    return CPU_BF16 if cpu_has_bf16_kernels() else device_type


def batch_limits(
    configured: int | None,
    cache_tokens: tuple[int, str] | None,
    *,
    max_new_tokens: int,
    context: int | None,
    device: str,
) -> BatchLimits:
    """The batch's limits: `configured` (``inference.max_batch_sequences``) when given, else sized from the KV
    budget `cache_tokens` (tokens, where they come from) and the `device` kind; the waiting line with it."""
    if configured is not None:
        size, reason = configured, "inference.max_batch_sequences"
    else:
        size, reason = sized_batch(cache_tokens, max_new_tokens=max_new_tokens, context=context, device=device)
    return BatchLimits(size, max(MIN_WAITING, size), reason)


def sized_batch(
    cache_tokens: tuple[int, str] | None, *, max_new_tokens: int, context: int | None, device: str
) -> tuple[int, str]:
    """(how many sequences of a typical length the KV budget holds, capped for `device`; why)."""
    cap = MAX_SEQUENCES.get(device, ACCELERATOR_MAX_SEQUENCES)
    typical = TYPICAL_PROMPT_TOKENS + max_new_tokens
    if context is not None:
        typical = min(typical, context)
    if cache_tokens is None:
        return cap, f"auto: the most on {device}; no KV budget was measured"
    fit = max(1, cache_tokens[0] // typical)
    why = f"the KV budget of {cache_tokens[0]:,} tokens holds {fit} sequences of {typical:,}"
    if fit > cap:
        return cap, f"auto: {why}, capped at {cap} on {device}"
    return fit, f"auto: {why}"
