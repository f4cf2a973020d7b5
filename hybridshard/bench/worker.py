"""One rank of the benchmark job: build every contestant, warm up, run the interleaved rounds, report.

[Note: bench timing]
Every contestant is built from the same seed and trained on the same batches (its ``k``-th step sees
batch ``k``), all in one process group, so they share the machine's state (caches, other load, the
link) as evenly as one job allows. After ``warmup`` untimed steps each, the job runs ``rounds``
rounds; a round runs ``steps`` steps of every contestant, the order rotated by one each round so no
contestant always follows the same other one. Each timed step is bracketed by barriers on the whole
job: ``barrier; t0; step; barrier; t1``, so a step's time is that of the slowest rank plus one
barrier (the same for every contestant, the floor included). Rank 0's times are reported; the
summary is the median with the 10th and 90th percentiles.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from typing import Any

import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard.bench import measure, stats
from hybridshard.bench.chart import write_chart
from hybridshard.bench.config import BenchConfig, System
from hybridshard.bench.compiled import CompileCounts, warm_inductor
from hybridshard.bench.hook_time import HookClock
from hybridshard.bench.model import rank_batch
from hybridshard.bench.progress import Progress
from hybridshard.bench.report import render_text
from hybridshard.bench.systems import Trainer, build_model, build_trainer

logger = logging.getLogger(__name__)

__all__ = ["run_worker", "JSON_NAME", "PNG_NAME"]

JSON_NAME = "bench.json"
PNG_NAME = "bench.png"


def _batch(cfg: BenchConfig, step: int) -> torch.Tensor:
    return rank_batch(step, dist.get_rank(), dist.get_world_size(), seed=cfg.seed, batch=cfg.batch, seq=cfg.seq,
                      vocab=cfg.vocab)


def _measured_step(trainer: Trainer, cfg: BenchConfig, groups, device: torch.device) -> tuple[torch.Tensor, dict]:
    """One untimed step that also records bytes per group and peak memory; see [Note: bench bytes]."""
    batch = _batch(cfg, trainer.steps_done).to(device)
    before = measure.state_bytes(trainer.model, trainer.optimizer)
    result: list[torch.Tensor] = []
    if trainer.contestant.system is System.HYBRIDSHARD:
        counting, source = hs.count_collectives(), "hybridshard.count_collectives"
    else:
        counting, source = measure.count_torch_collectives(groups), "torch.distributed calls, wrapped"
    with counting as counts:
        transient = measure.peak_step_bytes(lambda: result.append(trainer.step(batch)), device)
    facts = {
        "bytes_per_step": counts.by_group(),
        "bytes_source": source if trainer.contestant.system is not System.FLOOR else "no collectives",
        "state_bytes": before,
        "peak_bytes": before + transient,
    }
    return result[0], facts


def _barrier(device: torch.device) -> None:
    """A job-wide barrier that also waits for this rank's queued GPU work, so the clock sees it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _rotated(items: list, k: int) -> list:
    k %= len(items)
    return items[k:] + items[:k]


def run_worker(cfg: BenchConfig, out_dir: str, *, link: str, from_job: bool, print_report: bool) -> dict | None:
    """Run the benchmark on this rank; rank 0 writes ``bench.json`` and ``bench.png`` and returns the results."""
    owns_group = not dist.is_initialized()
    if owns_group:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.timeout_s))
    # Every system's hooks on one clock, from before any model is wrapped until the end (FSDP1 looks
    # some of its hooks up at each forward); see [Note: timing other systems' hooks].
    # Not under --compile: the wrappers around FSDP2's hooks must not change what dynamo traces in its blocks.
    timed = set() if cfg.compile else {c.system.value for c in cfg.contestants if c.system is not System.FLOOR}
    clock = HookClock().install(sorted(timed))
    try:
        return _run(cfg, out_dir, clock, link=link, from_job=from_job, print_report=print_report)
    finally:
        clock.uninstall()
        if owns_group:
            dist.destroy_process_group()


def _warm_up(t: Trainer, cfg: BenchConfig, groups, device: torch.device, compiles: CompileCounts,
             losses: dict[str, list[torch.Tensor]], facts: dict[str, dict]) -> None:
    """``cfg.warmup`` untimed steps of ``t``; the first is timed (the compile), the last is the measured one."""
    name = t.contestant.name
    for k in range(cfg.warmup):
        if k == 0:
            _barrier(device)
            t0 = time.perf_counter()
        with compiles.step(name):
            if k == cfg.warmup - 1:
                loss, facts[name] = _measured_step(t, cfg, groups, device)
            else:
                loss = t.step(_batch(cfg, t.steps_done).to(device))
        losses[name].append(loss)
        if k == 0:
            _barrier(device)
            compiles.first_step_ms[name] = (time.perf_counter() - t0) * 1e3


def _run(cfg: BenchConfig, out_dir: str, clock: HookClock, *, link: str, from_job: bool, print_report: bool) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.check_world(world)
    groups = hs.init_groups()
    device = groups.device or torch.device("cpu")
    trainers = [build_trainer(c, cfg, groups, device) for c in cfg.contestants]
    names = [t.contestant.name for t in trainers]
    progress = Progress(len(trainers) * (1 + cfg.rounds), enabled=rank == 0, machine=from_job)
    losses: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    facts: dict[str, dict] = {}
    compiles = CompileCounts()
    if cfg.compile:  # see [Note: cold compiles]
        warm_inductor()
    try:
        for t in trainers:  # warm-up; the first is timed (the compile), the last warm-up step is the measured one
            with compiles.cold(t.contestant.name) if cfg.compile else contextlib.nullcontext():
                _warm_up(t, cfg, groups, device, compiles, losses, facts)
            progress.advance(f"warm-up {t.contestant.name}")
    finally:
        compiles.close()
    times_ms: dict[str, list[float]] = {n: [] for n in names}
    clock.reset()
    for r in range(cfg.rounds):  # see [Note: bench timing]
        for t in _rotated(trainers, r):
            clock.label = t.contestant.name
            for _ in range(cfg.steps):
                batch = _batch(cfg, t.steps_done).to(device)
                _barrier(device)
                t0 = time.perf_counter()
                with compiles.step(t.contestant.name):
                    losses[t.contestant.name].append(t.step(batch))
                _barrier(device)
                times_ms[t.contestant.name].append((time.perf_counter() - t0) * 1e3)
            progress.advance(f"round {r + 1}/{cfg.rounds} {t.contestant.name}")
    progress.close()
    for t in trainers:  # the runtime's CPU overhead: wall time in its hooks, per unit and step
        facts[t.contestant.name]["compile"] = compiles.facts(t.contestant.name)
        # The same clock for every system, over the timed steps (off under --compile).
        if t.contestant.system is not System.FLOOR and not cfg.compile:
            facts[t.contestant.name]["hooks_ms_per_step"] = clock.seconds[t.contestant.name] * 1e3 / (
                cfg.rounds * cfg.steps)
            facts[t.contestant.name]["hooks_cpu_ms_per_step"] = clock.cpu_seconds[t.contestant.name] * 1e3 / (
                cfg.rounds * cfg.steps)
        if t.contestant.system is System.HYBRIDSHARD:
            seen = hs.comm_stats(t.model)
            steps = max(seen["steps"], 1)
            facts[t.contestant.name]["hook_ms_per_step"] = {u: sec * 1e3 / steps for u, sec in seen["hook_seconds"].items()}
            facts[t.contestant.name]["gather_wait_ms_per_step"] = {
                u: sec * 1e3 / steps for u, sec in seen["gather_wait_seconds"].items()}
    # (contestants, steps) local losses -> the global batch's mean loss per step
    mean_losses = torch.stack([torch.stack(losses[n]) for n in names]).double()
    dist.all_reduce(mean_losses)
    mean_losses /= world
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, {"facts": facts, "max_rss_bytes": measure.max_rss_bytes()})
    if rank != 0:
        return None
    results = _assemble(cfg, groups, names, times_ms, mean_losses.tolist(), everyone, link=link, device=device)
    _write(results, out_dir)
    if print_report:
        print(render_text(results), flush=True)
    return results


def _assemble(cfg: BenchConfig, groups, names: list[str], times_ms: dict[str, list[float]],
              losses: list[list[float]], per_rank: list[dict], *, link: str, device: torch.device) -> dict:
    """The JSON document (rank 0): configuration, then one entry per contestant."""
    by_name = dict(zip(names, losses))
    systems = {c.name: c.system for c in cfg.contestants}
    reference = next((n for n in names if systems[n] is System.HYBRIDSHARD),
                     next((n for n in names if systems[n] is not System.FLOOR), names[0]))
    floors = [n for n in names if systems[n] is System.FLOOR]
    compared_steps = cfg.warmup + cfg.steps
    agreement = stats.loss_agreement(by_name, reference=reference, num_steps=compared_steps, first_step_only=floors)
    timings = {n: stats.summarize(times_ms[n]) for n in names}
    medians = {n: timings[n].median_ms for n in names}
    entries = {}
    for c in cfg.contestants:
        n = c.name
        entries[n] = {
            "system": c.system.value,
            "options": {k: v for k, v in c.options},
            "median_ms": timings[n].median_ms,
            "p10_ms": timings[n].p10_ms,
            "p90_ms": timings[n].p90_ms,
            "times_ms": times_ms[n],
            "ratio": stats.ratios(medians, n),
            "losses": by_name[n],
            "loss_max_abs_diff": agreement[n],
            "loss_compared_steps": 1 if n in floors else compared_steps,
            "bytes_per_step": per_rank[0]["facts"][n]["bytes_per_step"],
            "bytes_source": per_rank[0]["facts"][n]["bytes_source"],
            "bytes_per_step_by_rank": [r["facts"][n]["bytes_per_step"] for r in per_rank],
            "state_bytes": max(r["facts"][n]["state_bytes"] for r in per_rank),
            "peak_bytes": max(r["facts"][n]["peak_bytes"] for r in per_rank),
            "hook_ms_per_step_by_rank": [r["facts"][n].get("hook_ms_per_step") for r in per_rank],
            "hooks_ms_per_step_by_rank": [r["facts"][n].get("hooks_ms_per_step") for r in per_rank],
            "hooks_cpu_ms_per_step_by_rank": [r["facts"][n].get("hooks_cpu_ms_per_step") for r in per_rank],
            "gather_wait_ms_per_step_by_rank": [r["facts"][n].get("gather_wait_ms_per_step") for r in per_rank],
            "compile": per_rank[0]["facts"][n]["compile"],
        }
    return {
        "benchmark": "hybridshard bench",
        "strategy": cfg.strategy,
        "link": link,
        "world_size": dist.get_world_size(),
        "shard_size": groups.shard_size,
        "replicate_size": groups.replicate_size,
        "shard_groups": [list(g) for g in groups.plan.shard_groups],
        "replicate_groups": [list(g) for g in groups.plan.replicate_groups],
        "device": str(device),
        "backend": str(dist.get_backend()),
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
        "model": {"d_model": cfg.d_model, "layers": cfg.layers, "heads": cfg.heads, "seq": cfg.seq,
                  "global_batch": cfg.batch, "vocab": cfg.vocab, "dtype": "float32", "optimizer": "AdamW",
                  "lr": cfg.lr, "params": sum(p.numel() for p in build_model(cfg).parameters())},
        "schedule": {"warmup": cfg.warmup, "rounds": cfg.rounds, "steps_per_round": cfg.steps,
                     "order": "rotated by one contestant per round"},
        "reference": reference,
        "compile": cfg.compile,
        "max_rss_bytes_by_rank": [r["max_rss_bytes"] for r in per_rank],
        "systems": entries,
    }


def _write(results: dict, out_dir: str) -> None:
    import json

    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, JSON_NAME)
    with open(path + ".tmp", "w") as f:
        json.dump(results, f, indent=1)
    os.replace(path + ".tmp", path)
    chart = os.path.join(out_dir, PNG_NAME)
    try:
        write_chart(results, chart)
    except ImportError as err:
        logger.warning("no chart written (%s): install matplotlib, e.g. pip install 'hybridshard[bench]'", err)
