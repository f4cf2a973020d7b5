"""A small HYBRID_SHARD job with the straggler report on, for the local cluster with racks
(tests/test_stragglers_cluster.py, benchmarks/straggler_detection.py).

Shards inside a host, replicates across hosts (in two hops with racks: ``rack_reduce=True``), reports
every ``HYBRIDSHARD_STRAGGLER_STEPS`` steps (10 unless set) into ``stragglers.jsonl`` of the run
directory, and prints ``step <i> `` on rank 0 before each step, so the local cluster's
``--set-rate-when 'step 42 '`` shapes a link at a known step. Slowness injected inside a rank, from
``--slow-from`` on: ``--inject sleep`` (rank ``--target``'s loader sleeps ``--factor`` x the median step so
far) or ``--inject throttle`` (rank ``--target``'s CPU capped at ``--cpu`` of one CPU:
:func:`hybridshard.launcher.inject.throttle_cpu`). ``--load``: a CPU hog thread in every rank for the
whole run (background load). Rank 0 also writes ``job-steps.json`` (each step's start, ``time.time()``)
and, with ``--dump``, ``summaries.jsonl`` (every report's rank summaries) to the run directory.
"""

import argparse
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.launcher.inject import CpuHog, SleepyLoader, throttle_cpu


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(torch.relu(self.fc1(x)))


def _dump_summaries(path: str) -> None:
    from hybridshard.runtime.faults import verdicts

    update = verdicts.Tracker.update

    def dumped(self, summaries):
        with open(path, "a") as f:
            f.write(json.dumps([s.to_json() for s in summaries]) + "\n")
        return update(self, summaries)
    verdicts.Tracker.update = dumped


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--blocks", type=int, default=4)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--inject", choices=("none", "sleep", "throttle"), default="none")
    p.add_argument("--target", type=int, default=3)
    p.add_argument("--slow-from", type=int, default=100)
    p.add_argument("--factor", type=float, default=0.8)
    p.add_argument("--cpu", type=float, default=0.2)
    p.add_argument("--load", type=float, default=0.0, help="share of a CPU each rank's hog thread takes")
    p.add_argument("--dump", action="store_true", help="rank 0: every report's summaries to summaries.jsonl")
    args = p.parse_args()
    os.environ.setdefault("HYBRIDSHARD_STRAGGLER_STEPS", "10")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    run_dir = os.environ.get("HYBRIDSHARD_RUN_DIR", ".")
    if args.dump and rank == 0:
        _dump_summaries(os.path.join(run_dir, "summaries.jsonl"))
    torch.manual_seed(0)
    model = nn.Sequential(*(Block(args.dim) for _ in range(args.blocks)))
    model = hs.shard(model, strategy=hs.ShardingStrategy.HYBRID_SHARD, wrap={Block}, device=torch.device("cpu"),
                     stragglers=True, rack_reduce=True if os.environ.get("HYBRIDSHARD_NETWORK_PATH") else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    hog = CpuHog(args.load).start() if args.load > 0 else None
    slow, times, delay, throttle = args.inject != "none" and rank == args.target, [], 0.0, None
    starts = []
    for step in range(args.steps):
        starts.append(time.time())
        if rank == 0:
            print(f"step {step} ", flush=True)
        if slow and step == args.slow_from:
            delay = args.factor * statistics.median(times[-20:])
            if args.inject == "throttle":
                throttle = throttle_cpu(os.getpid(), args.cpu, name=f"hybridshard-throttle-{os.getpid()}")
            print(f"rank {rank}: {args.inject} from step {step}", flush=True)
        started = time.perf_counter()
        sleep = delay if args.inject == "sleep" else 0.0
        x = next(iter(SleepyLoader([torch.randn(args.batch, args.dim)], seconds=sleep, slow=slow)))
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
    if hog is not None:
        hog.stop()
    if isinstance(throttle, CpuHog):
        throttle.stop()
    if rank == 0:
        with open(os.path.join(run_dir, "job-steps.json"), "w") as f:
            json.dump({"starts": starts}, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
