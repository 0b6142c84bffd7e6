"""The batch's logits under `tp`: gathered on rank 0 alone (`tp_modules.gather_vocab_on_first`, what a batch step
does now) against gathered on every rank (`gather_vocab`, what it did before and what a forward outside the batch
does), side by side on gloo ranks, the demo model's vocabulary (49,152) split between them.

    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 \\
        bench/bench_logits_gather.py [--rows 1,8,32,64] [--repeat 50]

Prints, on rank 0, the mean ms per gather of each kind for each number of rows, measured interleaved.
"""

from __future__ import annotations

import argparse
import time

VOCAB = 49152


def mean_ms(fn, repeat: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    start = time.perf_counter()
    for _ in range(repeat):
        fn()
    dist.barrier()
    return (time.perf_counter() - start) / repeat * 1e3


def main() -> None:
    import torch
    import torch.distributed as dist

    from shardbook.rankd.parallel.tp_modules import gather_vocab, gather_vocab_on_first

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,8,32,64")
    parser.add_argument("--repeat", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    world, group = dist.get_world_size(), dist.group.WORLD
    sizes = [VOCAB // world + (r < VOCAB % world) for r in range(world)]
    if dist.get_rank() == 0:
        print(f"{world} gloo ranks, vocabulary {VOCAB}, float32; ms per gather (mean of {args.repeat}, 2 rounds)")
        print("| rows | on every rank | on rank 0 alone | every / rank 0 |")
        print("|---|---|---|---|")
    for rows in (int(n) for n in args.rows.split(",")):
        local = torch.randn(rows, sizes[dist.get_rank()])
        every, first = [], []
        for _ in range(2):  # interleaved
            every.append(mean_ms(lambda local=local: gather_vocab(local, group, sizes), args.repeat))
            first.append(mean_ms(lambda local=local: gather_vocab_on_first(local, group, sizes), args.repeat))
        if dist.get_rank() == 0:
            e, f = min(every), min(first)
            print(f"| {rows} | {e:.2f} | {f:.2f} | {e / f:.2f}x |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
