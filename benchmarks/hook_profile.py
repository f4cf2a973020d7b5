"""Where the hooks' time goes: hybridshard, FSDP1 and FSDP2 profiled the same way in one job.

    OMP_NUM_THREADS=1 python benchmarks/hook_profile.py [--steps 6] [--warmup 2] [--top 14] [--functions 0] [--clock wall|cpu]

Spawns 4 gloo ranks on 2 simulated nodes (``HYBRIDSHARD_NODE_NAME``), builds the three systems of
``hybridshard bench`` on its default model (:mod:`hybridshard.bench.systems`, same seed, same groups)
and on rank 0 first runs one step with live tensor bytes counted
(:class:`hybridshard.bench.live_bytes.LiveTensorBytes`), then ``--steps`` steps with ``cProfile``
switched on only while the rank is inside one of the system's hook entry points (those of
:mod:`hybridshard.bench.hook_time`; the other ranks run the same steps unprofiled, a barrier
separates the steps). It prints, per system and per step:

- the wall time in hooks, what of it was blocked (``Work.wait`` on a collective, lock and event
  waits) and the rest, the hooks' own work; the CPU time of the threads inside the hooks (with
  hybridshard's communication thread, as ``hybridshard bench``'s ``hook cpu`` column); and the
  process's CPU time (all threads) per step;
- the self time of every function that ran inside the hooks, grouped by category (hybridshard's
  runtime by concept, FSDP's by file, torch's C functions by name);
- what was alive at the peak of the live-bytes step, by the op that allocated it;
- with ``--functions N``, the N functions with the most self time.

cProfile adds a fixed cost per Python call, so Python-heavy code looks slower than it is; the same
tax applies to every system, so compare the rows, not the absolute figures, with ``hybridshard
bench`` (which times hooks without a profiler).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import tempfile
import time
from collections import defaultdict

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, NODES = 4, 2
SYSTEMS = ("hybridshard", "fsdp1", "fsdp2")

OWN_FILES = {"hybridshard": "hybridshard/runtime/", "fsdp1": "torch/distributed/fsdp/",
             "fsdp2": "torch/distributed/fsdp/"}

# hybridshard function name -> category (anything else in hybridshard/runtime: "other runtime Python")
CATEGORIES = {
    "begin": "watchdog begin/end", "end": "watchdog begin/end", "attach_work": "watchdog begin/end",
    "issue_step_check": "step check", "verify": "step check", "fingerprint": "step check",
    "hand_off": "hand_off aliases + sweep", "sweep": "hand_off aliases + sweep",
    "_sweep_locked": "hand_off aliases + sweep", "<listcomp>": "hand_off aliases + sweep",
    "<genexpr>": "hand_off aliases + sweep",
    "record": "counters + issue order", "note": "counters + issue order", "ring_bytes": "counters + issue order",
    "add": "counters + issue order",
    "unsharded_views": "views (create/install)", "_install_views": "views (create/install)",
    "_install_params": "views (create/install)",
    "alloc_storage": "storage alloc/free", "free_storage": "storage alloc/free", "_free_storage": "storage alloc/free",
    "writeback_params": "master checks (writeback, versions, unchanged)",
    "master_versions": "master checks (writeback, versions, unchanged)",
    "shard_view": "master checks (writeback, versions, unchanged)",
    "check_unchanged": "master checks (writeback, versions, unchanged)",
    "_sum_received": "reduce-scatter local sum", "_sums_locally": "reduce-scatter local sum",
    "accumulate_grad_shard": "grad shard -> .grad", "_existing_grad_shard": "grad shard -> .grad",
}
C_CATEGORIES = {
    "resize_": "storage alloc/free", "untyped_storage": "storage alloc/free", "empty": "buffers (empty/zeros)",
    "zeros": "buffers (empty/zeros)", "empty_like": "buffers (empty/zeros)", "copy_": "copies", "add_": "local sums",
    "div_": "scaling", "detach": "detach/alias", "view": "views (create/install)",
    "wait": "BLOCKED: Work.wait (collective)", "acquire": "BLOCKED: lock/event (comm thread)",
    "all_to_all_single": "issue collective (C)", "all_gather_into_tensor": "issue collective (C)",
    "allreduce": "issue collective (C)", "allgather_into_tensor_coalesced": "issue collective (C)",
    "_allgather_base": "issue collective (C)", "reduce_scatter_tensor": "issue collective (C)",
    "_reduce_scatter_base": "issue collective (C)", "alltoall_base": "issue collective (C)",
    "_use_count": "hand_off aliases + sweep",
}
BLOCKED = ("BLOCKED: Work.wait (collective)", "BLOCKED: lock/event (comm thread)")


def _key(func: tuple) -> tuple[str, str]:
    return func[0].replace(os.sep, "/"), func[2]


def _c_name(name: str) -> str:
    # "<method 'resize_' of 'torch._C.StorageBase' objects>" -> "resize_"; "<built-in method torch.empty>" -> "empty"
    for marker in ("<method '", "<built-in method "):
        if name.startswith(marker):
            name = name[len(marker):].split("'")[0].split(" ")[0]
    return name.rstrip(">").rsplit(".", 1)[-1]


def summarize(stats: pstats.Stats, system: str, hook_seconds: float, steps: int) -> dict:
    """Self time of every function run inside the hooks (the profiler runs only there), by category."""
    own = OWN_FILES[system]
    rows: dict[str, float] = defaultdict(float)
    functions: dict[str, float] = defaultdict(float)
    for f, (_, _, tt, _, _) in stats.stats.items():
        path, name = _key(f)
        functions[f"{path.split('/')[-1]}:{f[1]} {name}" if f[0] != "~" else name] += tt
        if f[0] == "~":
            cname = _c_name(name)
            label = C_CATEGORIES.get(cname, f"torch C: {cname}")
        elif own in path:
            label = CATEGORIES.get(name, "other runtime Python") if system == "hybridshard" else \
                f"{path.split('/')[-1]} (Python)"
        elif "hybridshard/bench/hook_time.py" in path:
            label = "(the hook clock itself)"
        else:
            label = "torch/stdlib Python: " + path.split("/")[-1]
        rows[label] += tt
    per_step = 1e3 / steps
    return {"hooks_ms": hook_seconds * per_step, "rows": {k: v * per_step for k, v in rows.items()},
            "functions": {k: v * per_step for k, v in functions.items()}}


def _rank(rank: int, store: str, steps: int, warmup: int, out: str, clock_name: str = "wall") -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank % (WORLD // NODES)),
                      LOCAL_WORLD_SIZE=str(WORLD // NODES), HYBRIDSHARD_NODE_NAME=f"node{rank // (WORLD // NODES)}")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD)
    import hybridshard as hs
    from hybridshard.bench.config import BenchConfig, Contestant, System
    from hybridshard.bench.model import rank_batch
    from hybridshard.bench.hook_time import HookClock
    from hybridshard.bench.live_bytes import LiveTensorBytes
    from hybridshard.bench.systems import build_trainer

    cfg = BenchConfig()
    groups = hs.init_groups()
    device = torch.device("cpu")
    timer = time.thread_time if clock_name == "cpu" else time.perf_counter
    profiler = cProfile.Profile(timer)
    profiling = [False]
    clock = HookClock(on_enter=lambda: profiling[0] and profiler.enable(),
                      on_exit=lambda: profiling[0] and profiler.disable()).install(SYSTEMS)
    results = {}
    for name in SYSTEMS:
        trainer = build_trainer(Contestant(System(name)), cfg, groups, device)
        batch = lambda: rank_batch(trainer.steps_done, rank, WORLD, seed=cfg.seed, batch=cfg.batch,
                                   seq=cfg.seq, vocab=cfg.vocab)
        for _ in range(warmup):
            trainer.step(batch())
        if rank == 0:  # one step with live tensor bytes counted: what is alive at its peak
            live = LiveTensorBytes()
            with live, live.counting_resizes():
                trainer.step(batch())
            alive: dict[str, int] = defaultdict(int)
            for label, nbytes in live.alive_at_peak().values():
                alive[label] += nbytes
            peak = live.peak()
        else:
            trainer.step(batch())
        profiler = cProfile.Profile(timer)
        clock.reset()
        clock.label = name
        cpu = 0.0
        for _ in range(steps):
            tokens = batch()
            dist.barrier()
            profiling[0] = rank == 0
            started = time.process_time()
            trainer.step(tokens)
            cpu += time.process_time() - started
            profiling[0] = False
        dist.barrier()
        if rank == 0:
            results[name] = summarize(pstats.Stats(profiler), name, clock.seconds[name], steps)
            results[name]["cpu_ms"] = cpu * 1e3 / steps
            results[name]["hooks_cpu_ms"] = clock.cpu_seconds[name] * 1e3 / steps
            results[name]["cpu_by_entry"] = {entry: sec * 1e3 / steps for (label, entry), sec in clock.cpu_by_entry.items()
                                             if label == name}
            results[name]["peak_bytes"], results[name]["alive_at_peak"] = peak, dict(alive)
        del trainer
    clock.uninstall()
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def render(results: dict, top: int, functions: int = 0) -> str:
    names = list(results)
    lines = ["per step, rank 0, under cProfile (ms)      " + "  ".join(f"{n:>12}" for n in names)]
    blocked = {n: sum(results[n]["rows"].get(b, 0.0) for b in BLOCKED) for n in names}
    for label, values in (("in hooks (wall, profiler on)", {n: results[n]["hooks_ms"] for n in names}),
                          ("  blocked (Work.wait, lock/event waits)", blocked),
                          ("  the hooks' own work", {n: results[n]["hooks_ms"] - blocked[n] for n in names}),
                          ("CPU time in hooks (+ hybridshard's comm thread)", {n: results[n]["hooks_cpu_ms"] for n in names}),
                          ("process CPU time per step, all threads", {n: results[n]["cpu_ms"] for n in names})):
        lines.append(f"{label:<42}" + "  ".join(f"{values[n]:12.1f}" for n in names))
    for n in names:
        lines.append(f"\n{n}: CPU time per hook entry point (the clock's own measure, ms/step)")
        for entry, ms in sorted(results[n]["cpu_by_entry"].items(), key=lambda kv: -kv[1]):
            lines.append(f"  {entry[:60]:<62}{ms:8.2f}")
        lines.append(f"\n{n}: self time inside the hooks by category (ms/step)")
        rows = sorted(results[n]["rows"].items(), key=lambda kv: -kv[1])
        for label, ms in rows[:top]:
            lines.append(f"  {label:<52}{ms:8.2f}")
        rest = sum(ms for _, ms in rows[top:])
        if rest:
            lines.append(f"  {'(the rest)':<52}{rest:8.2f}")
        lines.append(f"  alive at the step's peak of live tensor bytes ({results[n]['peak_bytes'] / 1e6:.1f} MB above "
                     "the step's start), by what allocated it (MB):")
        for label, nbytes in sorted(results[n]["alive_at_peak"].items(), key=lambda kv: -kv[1])[:top]:
            lines.append(f"    {label[:60]:<62}{nbytes / 1e6:8.2f}")
        if functions:
            lines.append(f"  the {functions} functions with the most self time:")
            for label, ms in sorted(results[n]["functions"].items(), key=lambda kv: -kv[1])[:functions]:
                lines.append(f"    {label[:80]:<82}{ms:8.2f}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=14, help="categories listed per system")
    parser.add_argument("--functions", type=int, default=0, help="also list this many functions per system")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="what the profiler charges: wall time, or the thread's CPU time (blocked time then "
                             "counts nothing, so the 'blocked' rows are near 0 and the rest is the hooks' own work)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "profile.pt")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"), args.steps, args.warmup, out, args.clock), nprocs=WORLD)
        results = torch.load(out)
    print(render(results, args.top, args.functions))


if __name__ == "__main__":
    main()
