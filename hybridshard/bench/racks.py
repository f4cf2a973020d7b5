"""``hybridshard bench --racks``: the replicate reduction's forms side by side on racks behind a spine.

[Note: rack bench rows]
One job on ``launch/local-cluster --racks P`` (every host's ``HYBRIDSHARD_NETWORK_PATH`` set, the racks'
uplinks to the spine shaped), every row trained from the same seed on the same batches, interleaved
as [Note: bench timing] describes:

- ``flat, cyclic order``: the flat all-reduce over rings that interleave racks, as a cyclic launch
  (racks alternating in global-rank order) gives them; the local cluster numbers hosts rack by rack,
  so the plan's rows are re-ordered position-major and the groups created in that order;
- ``flat, network order``: the plan :func:`hybridshard.init_groups` makes, ``rack_reduce=False``;
- ``two hops``: the same groups, ``rack_reduce=True``;
- ``auto``: ``rack_reduce=None``, the cost model's choice (rates measured at ``shard()``);
- ``fsdp2``: FSDP2's HSDP (``fully_shard`` per block) on the network-ordered mesh;
- ``floor``: no communication, the compute the cost model's step adds its communication time to.

Spine bytes are the uplinks' own ``/sys/class/net/<uplink>/statistics/tx_bytes``, read by rank 0
through the driver's view of them (``/proc/<driver pid>/root/sys/...``: the ranks run in other network
namespaces) around each row's timed steps: what the racks sent to the spine, summed, per step; beside
them :func:`hybridshard.link_cost.level_bytes` for the row's rings, and the cost model's ratio of two
hops to flat beside the measured one.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import time
import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard import link_cost
from hybridshard.bench import stats
from hybridshard.bench.config import BenchConfig, Contestant, System
from hybridshard.bench.model import rank_batch
from hybridshard.bench.systems import build_trainer
from hybridshard.topology.groups import build_groups

logger = logging.getLogger(__name__)

__all__ = ["COUNTERS_ENV", "ROWS", "run_racks_worker", "render_racks"]

COUNTERS_ENV = "HYBRIDSHARD_SPINE_COUNTERS"
"""Comma-separated paths of each rack uplink's ``tx_bytes`` counter, in rack order."""
RESULT_NAME = "bench-racks.json"

ROWS = (
    ("flat, cyclic order", "cyclic", Contestant(System.HYBRIDSHARD, (("rack_reduce", False),))),
    ("flat, network order", "network", Contestant(System.HYBRIDSHARD, (("rack_reduce", False),))),
    ("two hops", "network", Contestant(System.HYBRIDSHARD, (("rack_reduce", True),))),
    ("auto", "network", Contestant(System.HYBRIDSHARD, (("rack_reduce", None),))),
    ("fsdp2", "network", Contestant(System.FSDP2)),
    ("floor", "network", Contestant(System.FLOOR)),
)
FORMS = {"flat, cyclic order": "flat", "flat, network order": "flat", "two hops": "two_hop", "fsdp2": "flat"}


def _cyclic_groups(net: hs.ShardGroups) -> hs.ShardGroups:
    """The same ranks with every replicate group's ring interleaving racks; see [Note: rack bench rows]."""
    plan = net.plan
    racks = plan.rack_rows()
    order = [rows[p] for p in range(max(len(r) for r in racks)) for rows in racks if p < len(rows)]
    shard_groups = tuple(plan.shard_groups[row] for row in order)
    cyclic = dataclasses.replace(plan, shard_groups=shard_groups, replicate_groups=tuple(zip(*shard_groups)),
                                 shard_group_domains=tuple(plan.shard_group_domains[r] for r in order), row_racks=())
    return build_groups(cyclic, cluster=net.cluster, device=net.device)


def _spine_tx(paths: list[str]) -> list[int]:
    out = []
    for path in paths:
        with open(path) as f:
            out.append(int(f.read().strip()))
    return out


def _batch(cfg: BenchConfig, step: int) -> torch.Tensor:
    return rank_batch(step, dist.get_rank(), dist.get_world_size(), seed=cfg.seed, batch=cfg.batch, seq=cfg.seq,
                      vocab=cfg.vocab)


def _ring_orders(groups: hs.ShardGroups, racks_of_rank: dict[int, int]) -> list[list[int]]:
    """Each replicate group's members' racks in group-rank order (what a ring visits)."""
    return [[racks_of_rank[r] for r in g] for g in groups.plan.replicate_groups]


def run_racks_worker(cfg: BenchConfig, out_dir: str, *, spine_rate: str, node_rate: str) -> dict | None:
    """One rank of the rack bench; rank 0 writes ``bench-racks.json`` and returns the results."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=cfg.timeout_s))
    try:
        return _run(cfg, out_dir, spine_rate=spine_rate, node_rate=node_rate)
    finally:
        dist.destroy_process_group()


def _run(cfg: BenchConfig, out_dir: str, *, spine_rate: str, node_rate: str) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    cfg.check_world(world)
    net = hs.init_groups()
    if net.racks is None:
        raise RuntimeError(
            "bench --racks expects replicate groups over racks of equal size, found none: every host needs its "
            "HYBRIDSHARD_NETWORK_PATH and at least two nodes per rack; run it through `hybridshard bench --racks`"
        )
    by_order = {"network": net, "cyclic": _cyclic_groups(net)}
    device = net.device or torch.device("cpu")
    trainers = [(name, build_trainer(c, cfg, by_order[order], device)) for name, order, c in ROWS]
    paths = [p for p in os.environ.get(COUNTERS_ENV, "").split(",") if p]
    for _name, t in trainers:  # warm-up, untimed
        for _ in range(cfg.warmup):
            t.step(_batch(cfg, t.steps_done).to(device))
    times_ms: dict[str, list[float]] = {n: [] for n, _ in trainers}
    spine: dict[str, list[float]] = {n: [] for n, _ in trainers}
    for r in range(cfg.rounds):  # see [Note: bench timing]
        k = r % len(trainers)
        for name, t in trainers[k:] + trainers[:k]:
            dist.barrier()
            before = _spine_tx(paths) if rank == 0 and paths else None
            for _ in range(cfg.steps):
                batch = _batch(cfg, t.steps_done).to(device)
                dist.barrier()
                t0 = time.perf_counter()
                t.step(batch)
                dist.barrier()
                times_ms[name].append((time.perf_counter() - t0) * 1e3)
            if before is not None:
                after = _spine_tx(paths)
                spine[name].append(sum(a - b for a, b in zip(after, before)) / cfg.steps)
    if rank != 0:
        return None
    results = _assemble(cfg, net, by_order, trainers, times_ms, spine, spine_rate=spine_rate, node_rate=node_rate)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, RESULT_NAME), "w") as f:
        json.dump(results, f, indent=1)
    return results


def _rates(spine_rate: str, node_rate: str, per_rack_hosts: int, share: int) -> link_cost.LinkRates:
    """One replicate group's share of the links: ``share`` (the shard size) groups reduce at once."""
    rates = link_cost.LinkRates.parse(f"node={node_rate},spine={spine_rate}", per_rack=per_rack_hosts)
    return dataclasses.replace(rates, node_bytes_per_s=rates.node_bytes_per_s / share,
                               spine_bytes_per_s=rates.spine_bytes_per_s / share)


def _assemble(cfg, net, by_order, trainers, times_ms, spine, *, spine_rate: str, node_rate: str) -> dict:
    racks = net.racks
    plan = net.plan
    rack_index = {name: k for k, name in enumerate(dict.fromkeys(plan.row_racks))}
    racks_of_rank = {rank: rack_index[plan.row_racks[row]] for row, g in enumerate(plan.shard_groups) for rank in g}
    hosts_per_rack = len(plan.shard_groups) // racks.racks  # one shard group per host (domain="node")
    rates = _rates(spine_rate, node_rate, hosts_per_rack, net.shard_size)
    two = dict(trainers)["two hops"]
    # What each unit's replicate reduction moves: its fp32 gradient shard.
    unit_bytes = [u.flat.layout.shard_numel * 4 for u in two.model.hybridshard_runtime.units]
    shard_bytes = sum(unit_bytes)
    medians = {n: stats.summarize(v).median_ms for n, v in times_ms.items()}
    rows = {}
    for name, order, contestant in ROWS:
        form = FORMS.get(name)
        if name == "auto":
            form = "two_hop" if dict(trainers)[name].model.hybridshard_runtime.rack_reduce else "flat"
        predicted = None
        if form is not None:
            orders = _ring_orders(by_order[order], racks_of_rank)
            predicted = sum(link_cost.level_bytes(form, racks=racks.racks, per_rack=racks.per_rack, nbytes=shard_bytes,
                                                  order=o)["spine"] for o in orders)
        measured = stats.quantile(spine[name], 0.5) if spine[name] else None
        rows[name] = {"median_ms": medians[name], "p10_ms": stats.summarize(times_ms[name]).p10_ms,
                      "p90_ms": stats.summarize(times_ms[name]).p90_ms, "times_ms": times_ms[name],
                      "spine_bytes_per_step": measured, "spine_bytes_predicted": predicted,
                      "spine_ratio_to_predicted": measured / predicted if measured and predicted else None}
    flat_s = link_cost.predict_time("flat", racks=racks.racks, per_rack=racks.per_rack, unit_bytes=unit_bytes,
                                    rates=rates)
    two_s = link_cost.predict_time("two_hop", racks=racks.racks, per_rack=racks.per_rack, unit_bytes=unit_bytes,
                                   rates=rates, overlap=False)  # the runtime runs the phases one after another
    return {
        "benchmark": "hybridshard bench --racks", "strategy": cfg.strategy, "world_size": dist.get_world_size(),
        "racks": racks.racks, "per_rack": racks.per_rack, "shard_size": net.shard_size,
        "spine_rate": spine_rate, "node_rate": node_rate, "gradient_shard_bytes": shard_bytes,
        "schedule": {"warmup": cfg.warmup, "rounds": cfg.rounds, "steps_per_round": cfg.steps},
        "rows": rows,
        "predicted_comm_s": {"flat": flat_s, "two_hop": two_s},
        "two_hop_over_flat": {"measured": medians["two hops"] / medians["flat, network order"],
                              "predicted_comm": two_s / flat_s,
                              # the floor's compute plus the predicted communication, nothing overlapped
                              "predicted_step": (medians["floor"] / 1e3 + two_s) / (medians["floor"] / 1e3 + flat_s)},
        "auto_chose": "two hops" if dict(trainers)["auto"].model.hybridshard_runtime.rack_reduce else "flat",
        "cyclic_over_network": medians["flat, network order"] / medians["flat, cyclic order"],
        "auto_over_best": medians["auto"] / min(medians["two hops"], medians["flat, network order"]),
    }


def render_racks(results: dict) -> str:
    """The table ``hybridshard bench --racks`` prints."""
    lines = [f"racks {results['racks']} x {results['per_rack']} replicas per rack, shard size {results['shard_size']}, "
             f"spine {results['spine_rate']} per rack uplink, hosts {results['node_rate']}; gradient shard "
             f"{results['gradient_shard_bytes'] / 1e6:.2f} MB",
             f"{'row':<22}{'median ms':>11}{'p10':>9}{'p90':>9}{'spine MB/step':>15}{'predicted':>11}{'ratio':>8}"]
    for name, row in results["rows"].items():
        measured, predicted = row["spine_bytes_per_step"], row["spine_bytes_predicted"]
        lines.append(f"{name:<22}{row['median_ms']:>11.1f}{row['p10_ms']:>9.1f}{row['p90_ms']:>9.1f}"
                     f"{(measured or 0) / 1e6:>15.3f}{(predicted or 0) / 1e6:>11.3f}"
                     f"{(row['spine_ratio_to_predicted'] or 0):>8.3f}")
    ratio = results["two_hop_over_flat"]
    lines.append(f"two hops / flat (network order): measured step {ratio['measured']:.3f}; cost model: step "
                 f"{ratio['predicted_step']:.3f} (floor + communication), communication alone {ratio['predicted_comm']:.3f} "
                 f"({results['predicted_comm_s']['two_hop'] * 1e3:.0f} vs {results['predicted_comm_s']['flat'] * 1e3:.0f} ms)")
    lines.append(f"flat network order / flat cyclic order: {results['cyclic_over_network']:.3f}; auto chose "
                 f"{results['auto_chose']}, auto / best of the two: {results['auto_over_best']:.3f}")
    return "\n".join(lines)
