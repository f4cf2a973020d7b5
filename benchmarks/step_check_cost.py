"""What the default step check costs per training step, measured on its own (gloo, CPU).

    python benchmarks/step_check_cost.py [--world 4] [--iters 400] [--step-ms 285]

Spawns ``--world`` gloo ranks and times, per rank, what a training step spends on the default step
check (see [Note: step check] in hybridshard/runtime/comm/agreement.py). A step runs two checks (the
forward's and the backward's); each is issued, then compared once the compute it overlaps is done:

- ``issue``: building the fingerprint and starting its all-gather;
- ``compare``: waiting for it and comparing, after ``--overlap-ms`` of stand-in compute;
- ``blocking``: issue and compare back to back, the cost if nothing overlapped it.

The figures are medians over ``--iters`` iterations, the slowest rank's, after a barrier each; the
last lines divide the per-step cost (2 x (issue + compare)) by ``--step-ms`` (the median step time
``hybridshard bench`` measured for its default model on this machine). Run it on an otherwise idle
machine: ``hybridshard bench --variants hybridshard,hybridshard:check_steps=False`` measures the same
thing inside the step, where a 1 % difference is below this machine's run-to-run noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, store: str, iters: int, overlap: float, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    from hybridshard.runtime.comm import agreement

    def timed(fn) -> list[float]:
        samples = []
        for _ in range(iters):
            dist.barrier()
            t0 = time.perf_counter()
            fn()
            samples.append(time.perf_counter() - t0)
        return samples

    kw = dict(mode="sync", num_units=7, order_digest=12345)
    blocking = timed(lambda: agreement.issue_step_check("backward", **kw).verify())
    issue, compare = [], []
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        check = agreement.issue_step_check("forward", **kw)
        issue.append(time.perf_counter() - t0)
        time.sleep(overlap)  # the forward (or the first unit's backward) computing
        t0 = time.perf_counter()
        check.verify()
        compare.append(time.perf_counter() - t0)
    medians = [statistics.median(x) for x in (issue, compare, blocking)]
    mine = torch.tensor(medians, dtype=torch.float64)
    dist.all_reduce(mine, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out, "w") as f:
            f.write(" ".join(str(x) for x in mine.tolist()))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--iters", type=int, default=400)
    parser.add_argument("--step-ms", type=float, default=285.0)
    parser.add_argument("--overlap-ms", type=float, default=20.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out")
        mp.spawn(_rank, args=(args.world, os.path.join(tmp, "store"), args.iters, args.overlap_ms / 1e3, out),
                 nprocs=args.world)
        issue, compare, blocking = (float(x) for x in open(out).read().split())
    per_step = 2 * (issue + compare)
    print(f"{args.world} gloo ranks, {args.iters} iterations, medians of the slowest rank:")
    print(f"  issue:    {issue * 1e6:8.1f} us")
    print(f"  compare:  {compare * 1e6:8.1f} us (after {args.overlap_ms:.0f} ms of compute)")
    print(f"  blocking: {blocking * 1e6:8.1f} us (issue + compare with nothing in between)")
    share = lambda t: 100 * t / (args.step_ms / 1e3)  # noqa: E731
    print(f"  per step, as run: {per_step * 1e3:.3f} ms = {share(per_step):.2f} % of a {args.step_ms:.0f} ms step")
    print(f"  per step, if both blocked: {2 * blocking * 1e3:.3f} ms = {share(2 * blocking):.2f} %")


if __name__ == "__main__":
    main()
