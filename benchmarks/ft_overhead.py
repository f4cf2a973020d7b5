"""Steady-state step time of fault-tolerant mode against the plain replicate group, on shaped links.

Runs the same HYBRID_SHARD job (benchmarks/ft_worker.py) on `launch/local-cluster` (2 hosts x 2 ranks,
links shaped to --bandwidth), first over one job with the usual replicate group, then with
`hybridshard launch --fault-tolerant` (each host its own job; node 0's launcher starts the
lighthouse), alternating --rounds times. Reports the median step time of each over the steps both
hosts took part in (the first --warmup of those left out) and their ratio. Needs root (network namespaces).

    .venv/bin/python benchmarks/ft_overhead.py [--bandwidth 1gbit --width 1024 --steps 40 --rounds 2]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WORKER = os.path.join(ROOT, "benchmarks", "ft_worker.py")


def run(mode: str, args: argparse.Namespace) -> list[float]:
    workdir = tempfile.mkdtemp(prefix=f"ft-overhead-{mode}-")
    cmd = [sys.executable, os.path.join(ROOT, "launch", "local-cluster"), "--nodes", "2", "--procs-per-node", "2",
           "--inter-node-bandwidth", args.bandwidth, "--timeout", "300"]
    job = [sys.executable, WORKER, "--out", os.path.join(workdir, "{node}_rank{rank}.jsonl"), "--steps", str(args.steps),
           "--width", str(args.width), "--batch", "32",
           "--until-replicas", "2", "--full-steps", str(args.steps)]
    if not args.check_steps:
        job.append("--no-check-steps")
    if mode == "ft":
        cmd += ["--launch-arg=--fault-tolerant"]
    else:
        job += ["--plain"]
    done = subprocess.run([*cmd, "--", *job], capture_output=True, text=True,
                          env=dict(os.environ, RUST_LOG="error"))
    try:
        if done.returncode != 0:
            raise RuntimeError(f"{mode} run failed ({done.returncode}):\n{done.stdout[-4000:]}\n{done.stderr[-2000:]}")
        times = []
        for path in glob.glob(os.path.join(workdir, "*_rank*.jsonl")):
            with open(path) as f:
                recs = [json.loads(line) for line in f if line.strip()]
            # Only steps every replica took part in (in ft mode a late host first runs alone, then heals).
            times.append([r["seconds"] for r in recs if r["committed"] and r["replicas"] == 2][args.warmup:])
        if len(times) != 4 or min(map(len, times)) == 0:
            raise RuntimeError(f"{mode}: expected 4 rank logs with steps of both hosts, found {list(map(len, times))}:\n"
                               + done.stdout[-3000:])
        # A step ends when its slowest rank ends: per step, the max over ranks.
        return [max(col) for col in zip(*times)]
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--bandwidth", default="1gbit")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-check-steps", dest="check_steps", action="store_false",
                   help="shard(check_steps=False) in both: no step check crosses the hosts in the plain job")
    args = p.parse_args()
    steps: dict[str, list[float]] = {"plain": [], "ft": []}
    for _ in range(args.rounds):
        for mode in ("plain", "ft"):
            steps[mode] += run(mode, args)
            print(mode, f"median so far {statistics.median(steps[mode]) * 1e3:.1f} ms", flush=True)
    plain, ft = statistics.median(steps["plain"]), statistics.median(steps["ft"])
    print(json.dumps({"check_steps": args.check_steps, "bandwidth": args.bandwidth, "width": args.width, "plain_step_ms": plain * 1e3,
                      "ft_step_ms": ft * 1e3, "overhead": ft / plain - 1, "steps_each": len(steps["ft"])}))


if __name__ == "__main__":
    main()
