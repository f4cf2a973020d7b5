"""Where compiled hybridshard's step goes against its eager step: both profiled the same way in one job.

    OMP_NUM_THREADS=1 python benchmarks/compile_profile.py [--d-model 128 --layers 4 --seq 64 --batch 8]
        [--steps 20] [--profile-steps 6] [--top 25] [--backend inductor]

Spawns 2 gloo ranks on one node (shard group of 2: FULL_SHARD), builds ``hybridshard bench``'s
eager hybridshard and its ``compile=True`` variant (:mod:`hybridshard.bench.systems`, same seed,
same data), warms both up, then runs ``--steps`` steps of each, alternating, with barriers around
each step, and prints the median of each and the ratio. Then on rank 0 (rank 1 runs the same steps
unprofiled) ``torch.profiler`` records ``--profile-steps`` steps of each, and the ``--top`` ops by
self CPU time are printed per system, with the total profiled CPU time per step. docs/performance.md,
"Compiled".
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hybridshard.bench.model import add_shape_arguments

WORLD = 2


def _rank(rank: int, store: str, args: argparse.Namespace) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      HYBRIDSHARD_NODE_NAME="node0")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    import hybridshard as hs
    from hybridshard.bench.config import BenchConfig, Contestant, System
    from hybridshard.bench.model import rank_batch
    from hybridshard.bench.systems import build_trainer

    cfg = BenchConfig(d_model=args.d_model, layers=args.layers, heads=args.heads, seq=args.seq, batch=args.batch,
                      compile=True, contestants=(Contestant(System.HYBRIDSHARD),))
    groups = hs.init_groups()
    device = torch.device("cpu")
    compiled_options = (("compile", {"backend": args.backend}),)
    trainers = {"eager": build_trainer(Contestant(System.HYBRIDSHARD), cfg, groups, device),
                "compiled": build_trainer(Contestant(System.HYBRIDSHARD, compiled_options), cfg, groups, device)}

    def step(name: str) -> float:
        t = trainers[name]
        batch = rank_batch(t.steps_done, rank, WORLD, seed=0, batch=cfg.batch, seq=cfg.seq, vocab=cfg.vocab)
        dist.barrier()
        t0 = time.perf_counter()
        t.step(batch)
        dist.barrier()
        return (time.perf_counter() - t0) * 1e3

    for _ in range(3):
        for name in trainers:
            step(name)
    times: dict[str, list[float]] = {n: [] for n in trainers}

    def hook_seconds(name: str) -> tuple[float, float]:
        seen = hs.comm_stats(trainers[name].model)
        return sum(seen["hook_seconds"].values()), sum(seen["gather_wait_seconds"].values())

    before = {n: hook_seconds(n) for n in trainers}
    for k in range(args.steps):
        for name in (list(trainers) if k % 2 else list(trainers)[::-1]):
            times[name].append(step(name))
    hooks = {n: [(a - b) * 1e3 / args.steps for a, b in zip(hook_seconds(n), before[n])] for n in trainers}
    everyone: list = [None] * WORLD
    dist.all_gather_object(everyone, hooks)
    if rank == 0:
        med = {n: sorted(v)[len(v) // 2] for n, v in times.items()}
        print(f"d_model {cfg.d_model}, {cfg.layers} blocks, seq {cfg.seq}, global batch {cfg.batch}, 2 ranks, "
              f"backend {args.backend}: median step eager {med['eager']:.1f} ms, compiled {med['compiled']:.1f} ms "
              f"({med['compiled'] / med['eager']:.2f}x), {args.steps} alternating steps each", flush=True)
        for n in trainers:
            print(f"  {n}: mean ms per step in the runtime's hooks by rank "
                  f"{[round(h[n][0], 1) for h in everyone]}, of it waiting for gathers {[round(h[n][1], 1) for h in everyone]}")
    from torch.profiler import ProfilerActivity, profile

    for name in trainers:
        with profile(activities=[ProfilerActivity.CPU]) if rank == 0 else _null() as prof:
            for _ in range(args.profile_steps):
                step(name)
        if rank == 0:
            avg = prof.key_averages()
            total = sum(e.self_cpu_time_total for e in avg) / 1e3 / args.profile_steps
            print(f"\n== {name}: profiled self CPU {total:.1f} ms per step (profiler overhead included)")
            print(avg.table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=60))
    dist.destroy_process_group()


class _null:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_shape_arguments(p)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=6)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--backend", default="inductor")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args), nprocs=WORLD)


if __name__ == "__main__":
    main()
