"""Loading again returns the old model's memory: rank 0's resident memory stays flat across reloads."""

from __future__ import annotations

RSS = "print(next(int(line.split()[1]) for line in open('/proc/self/status') if line.startswith('VmRSS')) * 1024)"


def test_a_reload_after_a_chat_keeps_no_old_model(fresh_kernel):
    """Before, the batch scheduler of the first model kept it alive until the next request (+0.28 GiB of the demo
    model's 0.5 GiB in rank 0 after the second load, flat after); now the reload frees it and trims the heap."""
    kernel = fresh_kernel()

    def rss() -> int:
        return int(kernel.run(RSS).of_type("stream")[-1]["content"]["text"])

    after = []
    for _ in range(3):
        assert kernel.run("%load_sharded demo", timeout=300).status == "ok"
        after.append(rss())
        assert kernel.run("%%chat --max-new-tokens 4 --output text\nhi", timeout=120).status == "ok"
    growth = [(b - after[0]) / 2**30 for b in after[1:]]
    assert max(growth) < 0.12, f"rank 0 grew by {growth} GiB over the first load's {after[0] / 2**30:.2f} GiB"
