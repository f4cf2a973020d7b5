"""Seconds one lost node costs: fault-tolerant mode against a whole-job restart from the last checkpoint.

Two `hybridshard launch` agents on 127.0.0.1 (node0, node1), 2 ranks each, the same training job
(benchmarks/ft_worker.py, HYBRID_SHARD) in two modes, one after the other in one run:

* ft: `--fault-tolerant --max-restarts 1`, each node its own job, one lighthouse;
* restart: one job over both nodes, `--max-restarts 1`, a checkpoint every --save-every steps.

In each, rank 0 of node1 is SIGKILLed right after it logs step --kill-at. The cost is read from
node0's rank-0 log: the seconds from the kill until node0 commits a step past the last one it had
committed at the kill, minus one median step (what that step costs anyway). In ft mode node0 never
stops; in restart mode every worker restarts, reloads the checkpoint and redoes the steps since it.

    .venv/bin/python benchmarks/ft_failure_cost.py [--steps 40 --kill-at 25 --save-every 10]
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
WORKER = os.path.join(ROOT, "benchmarks", "ft_worker.py")


def _first_rank_log(pattern: str) -> str:
    """The log of the lowest rank an agent ran (the c10d rendezvous picks the agents' ranks)."""
    found = sorted(glob.glob(pattern.format(rank="*")), key=lambda p: (len(p), p))
    found = [p for p in found if p.endswith(".jsonl")]
    return found[0] if found else pattern.format(rank="none")


def _records(path: str) -> list[dict]:
    try:
        with open(path) as f:
            return [json.loads(line) for line in f if line.strip()]
    except FileNotFoundError:
        return []


def run(mode: str, args: argparse.Namespace, workdir: str) -> dict:
    from hybridshard.launcher.local_cluster import free_port

    lighthouse = None
    port = free_port()
    common = ["--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "2", "--max-restarts", "1"]
    job = ["--steps", str(args.steps), "--sleep", str(args.sleep), "--width", str(args.width), "--timeout", "5"]
    if mode == "ft":
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=1, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
        common = ["--fault-tolerant", "--lighthouse", lighthouse.address(), *common]
    else:
        job += ["--plain", "--ckpt", os.path.join(workdir, "ckpt"), "--save-every", str(args.save_every)]
    logs = [os.path.join(workdir, f"node{i}_rank{{rank}}.jsonl") for i in range(2)]
    agents = []
    env = dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="error", PYTHONPATH=ROOT)
    try:
        for i in range(2):
            cmd = [sys.executable, "-m", "hybridshard", "launch", *common, "--node-rank", str(i), WORKER,
                   "--out", logs[i], *job]
            agents.append(subprocess.Popen(cmd, env=dict(env, HYBRIDSHARD_NODE_NAME=f"node{i}"),
                                           stdout=open(os.path.join(workdir, f"agent{i}.out"), "wb"),
                                           stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 300
        while not any(r["step"] >= args.kill_at for r in _records(_first_rank_log(logs[1]))):
            if time.monotonic() > deadline or any(a.poll() is not None for a in agents):
                raise RuntimeError(f"{mode}: node1 never reached step {args.kill_at}; see {workdir}")
            time.sleep(0.01)
        killed = _records(_first_rank_log(logs[1]))[-1]
        survivor = _records(_first_rank_log(logs[0]))
        committed_at_kill = max(r["step"] for r in survivor if r["committed"])
        killed_at = time.time()
        os.kill(killed["pid"], signal.SIGKILL)
        for a in agents:
            if a.wait(600) != 0:
                raise RuntimeError(f"{mode}: an agent failed; see {workdir}")
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        if lighthouse is not None:
            lighthouse.shutdown()
    survivor = _records(_first_rank_log(logs[0]))
    step_s = statistics.median(r["seconds"] for r in survivor if r["committed"])
    back = min(r["t"] for r in survivor if r["committed"] and r["step"] > committed_at_kill and r["t"] > killed_at)
    return {"mode": mode, "median_step_s": step_s, "lost_s": back - killed_at - step_s,
            "survivor_restarted": len({r["pid"] for r in survivor}) > 1, "killed_at_step": killed["step"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--kill-at", type=int, default=25)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--sleep", type=float, default=0.1, help="seconds of extra work per step (the step time)")
    p.add_argument("--width", type=int, default=256)
    args = p.parse_args()
    out = []
    for mode in ("ft", "restart"):
        workdir = tempfile.mkdtemp(prefix=f"ft-cost-{mode}-")
        out.append(run(mode, args, workdir))
        shutil.rmtree(workdir, ignore_errors=True)
        print(json.dumps(out[-1]), flush=True)
    ft, restart = out
    print(f"seconds lost to one node failure: fault-tolerant {ft['lost_s']:.2f}, whole-job restart "
          f"{restart['lost_s']:.2f} (checkpoint every {args.save_every} steps, killed at step {args.kill_at}); "
          f"ratio restart/ft {restart['lost_s'] / max(ft['lost_s'], 1e-9):.1f}")


if __name__ == "__main__":
    main()
