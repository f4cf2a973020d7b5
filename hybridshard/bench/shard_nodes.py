"""``hybridshard bench --shard-nodes K``: one shard group over K nodes, flat against two hops.

[Note: multi-node shard bench rows]
One job on ``launch/local-cluster`` (each host's link shaped), the groups from
``init_groups(shard_size=K * ranks per node)``, every row trained from the same seed on the same
batches, interleaved as [Note: bench timing] describes:

- ``flat``: ``two_hop=False``, the flat collectives over the node-major shard group (a ring leaves
  each node once);
- ``two hops``: across nodes then inside them ([Note: a shard group in two hops]);
- ``two hops + secondary``: ``reshard_after_forward="node"``;
- ``fsdp2``: ``fully_shard`` per block over the same groups' mesh;
- ``floor``: no communication.

Bytes are each host's own link counter, ``/sys/class/net/eth0/statistics/tx_bytes`` inside its
namespace, read by its local rank 0 around each row's timed steps and summed over hosts per step;
beside them the count of the row's collectives (``hs.count_collectives``, ring model): a flat ring's
crossing edge per node, or ``g`` members' hop across nodes.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import time

import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard.bench import stats
from hybridshard.bench.config import BenchConfig, Contestant, System
from hybridshard.bench.model import rank_batch
from hybridshard.bench.systems import build_trainer

logger = logging.getLogger(__name__)

__all__ = ["RESULT_NAME", "ROWS", "render_shard_nodes", "run_shard_nodes_worker"]

RESULT_NAME = "bench-shard-nodes.json"
LINK = "/sys/class/net/eth0/statistics/tx_bytes"
ROWS = (
    ("flat", Contestant(System.HYBRIDSHARD, (("two_hop", False),))),
    ("two hops", Contestant(System.HYBRIDSHARD, (("two_hop", True),))),
    ("two hops + secondary", Contestant(System.HYBRIDSHARD, (("reshard_after_forward", "node"),))),
    ("fsdp2", Contestant(System.FSDP2)),
    ("floor", Contestant(System.FLOOR)),
)


def _tx() -> int:
    with open(LINK) as f:
        return int(f.read())


def _predicted(trainer, cfg: BenchConfig, g: int, flat: bool) -> float:
    """Bytes out of each node for one step of ``trainer``, summed over nodes, from its collectives."""
    batch = rank_batch(trainer.steps_done, dist.get_rank(), dist.get_world_size(), seed=cfg.seed, batch=cfg.batch,
                       seq=cfg.seq, vocab=cfg.vocab)
    with hs.count_collectives() as counts:
        trainer.step(batch)
    mine = sum(v for (_, group), v in counts.ring_bytes.items() if group == ("shard" if flat else "shard_across"))
    total = torch.tensor([mine * (1 if flat else g) / g], dtype=torch.float64)  # each rank's share of its node
    dist.all_reduce(total)
    return float(total)


def run_shard_nodes_worker(cfg: BenchConfig, out_dir: str, *, shard_nodes: int, node_rate: str) -> dict | None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        return _run(cfg, out_dir, shard_nodes, node_rate)
    finally:
        dist.destroy_process_group()


def _run(cfg: BenchConfig, out_dir: str, shard_nodes: int, node_rate: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.check_world(world)
    g = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    groups = hs.init_groups(shard_size=shard_nodes * g)
    if groups.shard_hops is None:
        raise RuntimeError(f"bench --shard-nodes {shard_nodes} expects a shard group over {shard_nodes} nodes with more "
                           f"than one rank on each, found shard size {groups.shard_size}; pass --nproc-per-node 2 or more")
    device = groups.device or torch.device("cpu")
    trainers = [(name, build_trainer(c, cfg, groups, device)) for name, c in ROWS]
    reader = int(os.environ.get("LOCAL_RANK", "0")) == 0
    for _, t in trainers:
        for _ in range(cfg.warmup):
            t.step(rank_batch(t.steps_done, rank, world, seed=cfg.seed, batch=cfg.batch, seq=cfg.seq,
                              vocab=cfg.vocab).to(device))
    predicted = {name: _predicted(t, cfg, g, flat=name == "flat") for name, t in trainers[:3]}
    times_ms: dict[str, list[float]] = {n: [] for n, _ in trainers}
    sent: dict[str, list[float]] = {n: [] for n, _ in trainers}
    for r in range(cfg.rounds):
        k = r % len(trainers)
        for name, t in trainers[k:] + trainers[:k]:
            dist.barrier()
            before = _tx() if reader else 0
            for _ in range(cfg.steps):
                batch = rank_batch(t.steps_done, rank, world, seed=cfg.seed, batch=cfg.batch, seq=cfg.seq,
                                   vocab=cfg.vocab).to(device)
                dist.barrier()
                t0 = time.perf_counter()
                t.step(batch)
                dist.barrier()
                times_ms[name].append((time.perf_counter() - t0) * 1e3)
            mine = torch.tensor([(_tx() - before) / cfg.steps if reader else 0.0], dtype=torch.float64)
            dist.all_reduce(mine)
            sent[name].append(float(mine))
    if rank != 0:
        return None
    medians = {n: stats.summarize(v).median_ms for n, v in times_ms.items()}
    rows = {}
    for name, _ in trainers:
        measured = stats.quantile(sent[name], 0.5)
        rows[name] = {"median_ms": medians[name], "p10_ms": stats.summarize(times_ms[name]).p10_ms,
                      "p90_ms": stats.summarize(times_ms[name]).p90_ms, "host_bytes_per_step": measured,
                      "host_bytes_predicted": predicted.get(name),
                      "ratio": measured / predicted[name] if predicted.get(name) else None}
    results = {"benchmark": "hybridshard bench --shard-nodes", "world_size": world, "shard_nodes": shard_nodes,
               "ranks_per_node": g, "node_rate": node_rate, "rows": rows,
               "schedule": {"warmup": cfg.warmup, "rounds": cfg.rounds, "steps_per_round": cfg.steps},
               "two_hops_over_flat": medians["two hops"] / medians["flat"],
               "two_hops_over_fsdp2": medians["two hops"] / medians["fsdp2"],
               "secondary_over_flat": medians["two hops + secondary"] / medians["flat"]}
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, RESULT_NAME), "w") as f:
        json.dump(results, f, indent=1)
    return results


def render_shard_nodes(results: dict) -> str:
    lines = [f"one shard group over {results['shard_nodes']} nodes x {results['ranks_per_node']} ranks, hosts' links "
             f"{results['node_rate']}",
             f"{'row':<22}{'median ms':>11}{'p10':>9}{'p90':>9}{'host MB/step':>14}{'predicted':>11}{'ratio':>8}"]
    for name, row in results["rows"].items():
        lines.append(f"{name:<22}{row['median_ms']:>11.1f}{row['p10_ms']:>9.1f}{row['p90_ms']:>9.1f}"
                     f"{row['host_bytes_per_step'] / 1e6:>14.3f}{(row['host_bytes_predicted'] or 0) / 1e6:>11.3f}"
                     f"{(row['ratio'] or 0):>8.3f}")
    lines.append(f"two hops / flat {results['two_hops_over_flat']:.3f}; two hops / fsdp2 {results['two_hops_over_fsdp2']:.3f}; "
                 f"two hops + secondary / flat {results['secondary_over_flat']:.3f}")
    return "\n".join(lines)
