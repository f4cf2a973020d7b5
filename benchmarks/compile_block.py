"""One bench-GPT block, eager against ``block.compile()``, in one process with no sharding at all.

    OMP_NUM_THREADS=1 python benchmarks/compile_block.py [--d-model 128 --seq 64 --batch 4]

What compiling costs or saves with no runtime around it: the floor that ``shard(..., compile=True)``
(one compiled block per unit) can reach on this machine. Prints the median of 30 steps (forward +
backward, and a ``no_grad`` forward) each way, and the first compiled step. docs/performance.md, "Compiled".
"""

from __future__ import annotations

import argparse
import time

import torch

from hybridshard.bench.model import Block


def _median_ms(fn, n: int = 30) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[n // 2] * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=4)
    args = p.parse_args()
    torch.manual_seed(0)
    block = Block(args.d_model, args.heads)
    x = torch.randn(args.batch, args.seq, args.d_model, requires_grad=True)

    def step() -> None:
        block(x).sum().backward()
        block.zero_grad(set_to_none=True)

    def forward() -> None:
        with torch.no_grad():
            block(x)

    eager, eager_fwd = _median_ms(step), _median_ms(forward)
    block.compile()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    forward()
    compiled, compiled_fwd = _median_ms(step), _median_ms(forward)
    print(f"block d_model {args.d_model}, seq {args.seq}, batch {args.batch}, {torch.get_num_threads()} thread(s), "
          f"torch {torch.__version__}")
    print(f"forward+backward: eager {eager:.2f} ms, compiled {compiled:.2f} ms ({compiled / eager:.2f}x); "
          f"no_grad forward: eager {eager_fwd:.2f} ms, compiled {compiled_fwd:.2f} ms "
          f"({compiled_fwd / eager_fwd:.2f}x); "
          f"first compiled step {first:.1f} s")


if __name__ == "__main__":
    main()
