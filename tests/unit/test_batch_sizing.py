"""The continuous batch's default size and waiting line (`kernel.api.batch_sizing`): from the KV budget and the
device, an explicit `inference.max_batch_sequences` or `--max-waiting` winning."""

from __future__ import annotations

from shardbook.kernel.api.batch_sizing import MIN_WAITING, batch_limits

BUDGET = "50% of rank 0's free memory"


def sized(tokens: int | None, *, configured: int | None = None, device: str = "cpu", context: int | None = 8192):
    budget = None if tokens is None else (tokens, BUDGET)
    return batch_limits(configured, budget, max_new_tokens=512, context=context, device=device)


def test_the_budget_sizes_the_batch_at_a_typical_length() -> None:
    limits = sized(10_000)  # 512 prompt tokens + 512 new: 9 sequences of 1,024 tokens
    assert (limits.max_sequences, limits.max_waiting) == (9, MIN_WAITING)
    assert "10,000 tokens holds 9 sequences of 1,024" in limits.reason
    assert sized(500).max_sequences == 1  # less than one typical sequence still runs one at a time
    assert sized(3_000, context=256).max_sequences == 11  # a short context shortens the typical sequence


def test_a_large_budget_is_capped_per_device_and_the_line_holds_another_batch() -> None:
    cpu, gpu = sized(10**7), sized(10**7, device="cuda")
    assert (cpu.max_sequences, cpu.max_waiting) == (32, 32) and "capped at 32 on cpu" in cpu.reason
    assert (gpu.max_sequences, gpu.max_waiting) == (256, 256)
    assert sized(None).max_sequences == 32 and "no KV budget" in sized(None).reason


def test_explicit_values_win() -> None:
    limits = sized(10**7, configured=8)
    assert (limits.max_sequences, limits.reason) == (8, "inference.max_batch_sequences")
    served = limits.with_waiting(4)
    assert served.max_waiting == 4 and "--max-waiting" in served.reason and served.max_sequences == 8
    assert limits.with_waiting(None) is limits
    assert "up to 8 sequences at once, 4 more waiting" in served.describe()


def test_a_cpu_with_bfloat16_kernels_takes_64_for_a_bfloat16_model(monkeypatch) -> None:
    from shardbook.kernel.api import batch_sizing
    from shardbook.rankd.parallel import fastest_dtype

    for native in (True, False):
        monkeypatch.setattr(fastest_dtype, "cpu_has_bf16_kernels", lambda native=native: native)
        kind = batch_sizing.device_kind("cpu", "bfloat16")
        assert kind == (batch_sizing.CPU_BF16 if native else "cpu")
        assert sized(10**7, device=kind).max_sequences == (64 if native else 32)
    monkeypatch.setattr(fastest_dtype, "cpu_has_bf16_kernels", lambda: True)
    assert batch_sizing.device_kind("cpu", "float32") == "cpu"  # float32 computes without them
    assert batch_sizing.device_kind("cuda", "bfloat16") == "cuda"
    limits = sized(10**7, device=batch_sizing.CPU_BF16)
    assert (limits.max_waiting, "capped at 64 on a cpu with bfloat16 kernels" in limits.reason) == (64, True)
