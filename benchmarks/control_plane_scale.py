"""The control plane at W ranks on one machine: the project's real heartbeat, watchdog and fault-check
code, one thread per rank, one real TCPStore.

    python benchmarks/control_plane_scale.py --world 64 256 1024 4096

Prints one JSON line per W (lines starting with ``{``; everything else is commentary) and, with
``--plot PATH`` and matplotlib installed, a log-log plot of each figure against W.

The fault phases (a healthy job, a stall of rank 0, a death) run W ranks as threads: see
``control_plane_ranks.py``. Init and checkpoint metadata are the bytes of the real payloads (each
rank's probe from the NVML fixtures, 8 ranks a node) that the object messages of
:func:`~hybridshard.topology.summary.gather_summary` (its gather tree, counted per receiving rank; for
comparison, the flat gather through rank 0 and the ``all_gather_object`` before it) move, and the
real packing, assembly and planning code timed once; the messages are not sent. Every rank then
creates its groups with the real ``build_groups`` on torch's threaded process group (the ``new_group``
path; see [Note: which creation path] in ``control_plane_groups.py``). The step check's cost is a
latency model (:func:`step_check_model`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import math
import os
import pickle
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, also when loaded by path (tests)

from control_plane_groups import groups_phase  # noqa: E402
from control_plane_ranks import fault_phases  # noqa: E402

from hybridshard.runtime.faults import asks, peers  # noqa: E402
from hybridshard.runtime.faults.rank_state import ControlPlane, bound  # noqa: E402

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nvml" / "dgx_h100_nvswitch.json"
RANKS_PER_NODE = 8
ALPHA_S = 5e-6
"""Latency of one message between nodes (the α of the α-β model)."""
BETA_S_PER_BYTE = 1 / 25e9
"""Seconds per byte at 25 GB/s (one 200 Gb/s NIC per GPU)."""


def _probes(world: int, layout: str = "block") -> list[Any]:
    """Every rank's real probe: one per node from the NVML fixture, node names and local ranks filled in;
    ranks in torchrun's ``"block"`` order or SLURM's ``"cyclic"`` (rank r on node r mod W/8)."""
    from hybridshard.topology.nvml_recorded import FakeNvml
    from hybridshard.topology.probe import probe_rank

    data = json.loads(FIXTURE.read_text())
    out = []
    for node in range(world // RANKS_PER_NODE):
        env = {"HYBRIDSHARD_NODE_NAME": f"node{node:05d}"}
        base = probe_rank(rank=0, local_rank=0, world_size=world, nvml=FakeNvml(data), env=env)
        # Every node's GPUs get their own UUIDs, as real ones have (the fixture has one node's).
        gpus = tuple(dataclasses.replace(g, uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_OID, f'{node}/{g.index}')}")
                     for g in base.node.gpus)
        base = dataclasses.replace(base, node=dataclasses.replace(base.node, hostname=f"node{node:05d}", gpus=gpus),
                                   visible_gpu_uuids=tuple(g.uuid for g in gpus))
        uuids = [g.uuid for g in gpus]
        for local in range(RANKS_PER_NODE):
            out.append(dataclasses.replace(base, rank=node * RANKS_PER_NODE + local, local_rank=local,
                                           gpu_uuid=uuids[local % len(uuids)]))
    if layout == "cyclic":
        num_nodes = world // RANKS_PER_NODE
        out = [dataclasses.replace(out[(r % num_nodes) * RANKS_PER_NODE + r // num_nodes], rank=r)
               for r in range(world)]
    return out


def _sent(obj: Any) -> int:
    """Bytes one object collective moves for ``obj``: its size (int64), then its pickle."""
    return 8 + len(pickle.dumps(obj))


def _delivered(obj: Any) -> Any:
    """``obj`` as a receiver of an object message holds it: unpickled."""
    return pickle.loads(pickle.dumps(obj))


def _gathered_bytes(payloads: list[Any]) -> int:
    """What ``all_gather_object`` leaves on each rank: W sizes, then W buffers of the largest pickle."""
    return 8 * len(payloads) + len(payloads) * max(_sent(p) - 8 for p in payloads)


def ckpt_meta_bytes(nodes: list[str]) -> tuple[int, int]:
    """Bytes a save's metadata exchange leaves on a rank other than 0, and on rank 0, for the ranks'
    node names ``nodes`` ([Note: checkpoint metadata at scale] in hybridshard/state/save_meta.py):
    the output buffers its collectives fill, its own piece included. Every rank: the all-gather of one
    int64 a rank (8 W) and the all-reduce of the longest name's length (8); rank 0 also the gather of
    every name padded to the longest (W x longest). ``tests/test_checkpoint.py`` checks these against
    what a real save's collectives fill on 4 ranks."""
    world, longest = len(nodes), max(1, max(len(n.encode("utf-8", "surrogateescape")) for n in nodes))
    member = 8 * world + 8
    return member, member + world * longest


def init_and_checkpoint(world: int, layout: str = "block", probes: list[Any] | None = None) -> dict[str, float]:
    """Bytes each rank receives in :func:`hybridshard.topology.summary.gather_summary` (the gather tree:
    parts to block leaders, their keys to rank 0, its choice of senders back, each node probe once to
    its leader, one blob of parts and node probes a block to rank 0, the view to all), from the real
    payloads, per rank; and the time through it on its critical path: a rank's part, rank 0's choice,
    the slowest leader's blob, rank 0's assembly, a rank's planning. ``probes``: :func:`_probes`'s, made
    once by a caller that compares (they list this machine's network interfaces, which can change)."""
    from hybridshard.topology import summary
    from hybridshard.topology.planner import plan_groups

    probes = _probes(world, layout) if probes is None else probes
    received = [0] * world
    t = time.perf_counter()
    parts = [summary.rank_part(p) for p in probes]
    part_s = (time.perf_counter() - t) / world  # each rank builds its own part
    # What each leader holds: its own part and its members' as received (unpickled copies, as the real
    # messages leave them: the pickles of what it packs depend on it).
    tree, held, pack_s = summary.blocks(world), [], 0.0
    for block in tree:
        held.append([parts[block[0]]] + [_delivered(parts[r]) for r in block[1:]])
        received[block[0]] += sum(_sent(parts[r]) for r in block[1:])
    t = time.perf_counter()
    keys = [summary.pack(summary.node_keys(mine)) for mine in held]
    chosen = summary.assign_senders([summary.unpack(k) for k in keys])
    assign_s = time.perf_counter() - t
    nodes: dict[Any, Any] = {}
    all_parts = []
    for block, mine, key_blob, given in zip(tree, held, keys, chosen):
        leader, senders = block[0], summary.sender_positions(mine, given)
        for i, r in enumerate(block[1:], start=1):
            received[r] += _sent(i in senders)
        sent = [probes[block[i]].node.to_dict() for i in senders]
        received[leader] += sum(_sent(node) for i, node in zip(senders, sent) if i)
        got = [node if i == 0 else _delivered(node) for i, node in zip(senders, sent)]
        t = time.perf_counter()
        blob = summary.pack((mine, got))
        pack_s = max(pack_s, time.perf_counter() - t)  # the leaders pack at once
        if leader:
            received[0] += _sent(key_blob) + _sent(blob)
            received[leader] += _sent(given)
            mine, got = summary.unpack(blob)
        all_parts += mine
        keys_there = summary.node_keys(mine)
        nodes.update({keys_there[k]: node for k, node in zip(given, got)})
    t = time.perf_counter()
    encoded = summary.encode_view(summary.view_from_parts(all_parts, nodes))
    plan_groups(summary.decode_view(encoded))
    init_s = part_s + assign_s + pack_s + time.perf_counter() - t
    for r in range(1, world):  # broadcast_object_list: the size, then the pickle
        received[r] += _sent(("view", encoded))
    leaders = [b[0] for b in tree[1:]] or [0]
    # Before the tree: rank 0 gathered every part, its GPU UUIDs in full (gather_object pads to the
    # largest), and each node once.
    flat = [r for r in {summary.node_key(p): r for r, p in reversed(list(enumerate(parts)))}.values() if r]
    rank0_flat = 8 * world + world * max(_sent({**p.to_dict(), "node": part["node"]}) - 8
                                         for p, part in zip(probes, parts))
    rank0_flat += sum(_sent(probes[r].node.to_dict()) for r in flat)
    nodes_of = [f"node{r // RANKS_PER_NODE:05d}" for r in range(world)]
    ckpt_member, ckpt_rank0 = ckpt_meta_bytes(nodes_of)
    # Before: node names, then bytes written, each through all_gather_object to every rank.
    ckpt_before = _gathered_bytes(nodes_of) + _gathered_bytes([1 << 40] * world)
    members = sorted(set(range(world)) - {b[0] for b in tree})
    return {"init_s": init_s, "init_ranks_per_block": len(tree[0]),
            "init_bytes_per_rank": max((received[r] for r in members), default=0),
            "init_bytes_leader": max(received[r] for r in leaders), "init_bytes_rank0": received[0],
            "init_bytes_max_rank": max(received), "init_bytes_rank0_flat": rank0_flat,
            "init_bytes_per_rank_all_gather": _gathered_bytes([p.to_dict() for p in probes]),
            "ckpt_meta_bytes_per_rank": ckpt_member, "ckpt_meta_bytes_rank0": ckpt_rank0,
            "ckpt_meta_bytes_per_rank_all_gather": ckpt_before}


def step_check_model(world: int) -> dict[str, float]:
    """Seconds per step check under the α-β model: the check before (a ring all-gather of 6 int64 from
    every rank: W-1 steps, each one message) against the check now (an all-reduce of a fixed 12 int64;
    a tree: 2 log2 W steps, up then down; a ring, for comparison: 2 (W-1) steps). See docs/scale.md."""
    steps = math.ceil(math.log2(world))
    return {"step_check_bytes_per_rank": 96, "step_check_bytes_per_rank_all_gather": 48 * world,
            "step_check_allgather_ring_s": (world - 1) * (ALPHA_S + 48 * BETA_S_PER_BYTE),
            "step_check_tree_s": 2 * steps * (ALPHA_S + 96 * BETA_S_PER_BYTE),
            "step_check_allreduce_ring_s": 2 * (world - 1) * (ALPHA_S + 96 / world * BETA_S_PER_BYTE)}


def follower_cost(world: int, repeats: int = 15) -> dict[str, float]:
    """CPU milliseconds one survivor spends on a full round's outcome at ``world`` ranks, alone on a core
    (best of ``repeats``): the reports read from the outcome's runs and the table printed from them, as a
    follower does ([Note: a follower's reports] in :mod:`hybridshard.runtime.faults.asks`), against every
    rank's report made one by one first. One rank lost, the others blocked in one collective."""
    mine = {"state": "collective", "text": f"rank 5: in all_reduce on world (ranks 0-{world - 1}) for 12s, step 3",
            "ranks": list(range(world)), "seconds": 12.0}
    given = [peers.Report(r, "collective", f"rank {r}: in all_reduce on world (ranks 0-{world - 1}) for {12 + r % 3}s, "
                          "step 3", range(world), "", 12.0 + r % 3) for r in range(1, world)]
    value = json.dumps({"lost": [[0, 1]], "reports": asks.compact(given)}, separators=(",", ":")).encode()
    plane = ControlPlane(object(), 5, world)
    best = {"runs": float("inf"), "made": float("inf")}
    with bound(plane):
        for _ in range(repeats):
            for way in best:
                t = time.thread_time()
                reports = asks._outcome(value, 5, world, mine, 9.0, brief=False)
                if way == "made":
                    reports = list(reports)
                peers.having(reports, ("raised", "failed", "done", "lost"))
                peers.table(reports)
                best[way] = min(best[way], time.thread_time() - t)
    return {"follower_ms": 1e3 * best["runs"], "follower_made_ms": 1e3 * best["made"]}


def run(world: int, fault_s: float, healthy_s: float, faults: bool, layout: str = "block",
        processes: int = 1, groups: bool = True) -> dict[str, Any]:
    from hybridshard.topology.cluster import assemble_cluster
    from hybridshard.topology.planner import plan_groups

    out: dict[str, Any] = {"world": world, "layout": layout, "fault_seconds": fault_s}
    probes = _probes(world, layout)
    out.update(init_and_checkpoint(world, layout, probes))
    if groups:
        out.update(groups_phase(plan_groups(assemble_cluster(probes))))
        # A rank's own time from its probe to its groups: the gather tree's critical path, then one
        # rank's CPU in build_groups alone. The phase's wall time is W threads' under one lock, and
        # their CPU clocks run slower for sharing two cores and one heap (docs/scale.md).
        out["init_groups_s"] = out["init_s"] + out["groups_alone_cpu_ms"] / 1e3
    out.update(step_check_model(world))
    out.update(follower_cost(world))
    if not faults:
        return out
    out.update(fault_phases(world, fault_s, healthy_s, processes))
    return out


def _fit(results: list[dict[str, Any]], key: str) -> float | None:
    pts = [(math.log(r["world"]), math.log(r[key])) for r in results
           if isinstance(r.get(key), (int, float)) and r[key] > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


PLOTTED = ("init_s", "init_groups_s", "groups_alone_cpu_ms", "groups_cpu_ms_per_rank", "groups_store_ops_per_rank", "init_bytes_per_rank", "init_bytes_max_rank", "init_bytes_rank0", "store_ops_per_rank_per_s",
           "store_ops_per_check_per_rank", "store_bytes_per_check_per_rank", "detect_s", "ckpt_meta_bytes_per_rank",
           "step_check_allgather_ring_s", "step_check_tree_s")


def plot(results: list[dict[str, Any]], path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"no plot: matplotlib is not installed (pip install matplotlib), so {path} was not written")
        return
    fig, ax = plt.subplots(figsize=(8, 6))
    worlds = [r["world"] for r in results]
    for i, key in enumerate(PLOTTED):
        pts = [(w, r[key]) for w, r in zip(worlds, results) if isinstance(r.get(key), (int, float)) and r[key] > 0]
        if pts:  # ten colours, then the next line style: no two lines alike
            ax.plot(*zip(*pts), marker="os^"[i // 10], linestyle=("-", "--", ":")[i // 10], label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size W (ranks, 8 per node)")
    ax.set_title("hybridshard control plane against W (benchmarks/control_plane_scale.py)")
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1.01, 0.5))
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--fault-seconds", type=float,
                        default=float(os.environ.get("HYBRIDSHARD_FAULT_SECONDS", "4")),
                        help="HYBRIDSHARD_FAULT_SECONDS for the stall and death phases (the stall lasts 1.5x it)")
    parser.add_argument("--healthy-seconds", type=float, default=5.0)
    parser.add_argument("--no-faults", action="store_true", help="only the init, groups, checkpoint and model figures")
    parser.add_argument("--no-groups", action="store_true", help="skip creating every rank's groups (new_group, threads)")
    parser.add_argument("--layout", choices=("block", "cyclic"), default="block",
                        help="rank order of the init probes (the fault phases do not depend on it)")
    parser.add_argument("--plot", default=None, help="write a log-log PNG here (needs matplotlib)")
    parser.add_argument("--processes", type=int, default=1,
                        help="spread the ranks of the fault phases over this many worker processes (threads in each)")
    parser.add_argument("--results", nargs="+", default=None,
                        help="fit and plot the JSON lines of earlier runs (files) instead of running")
    args = parser.parse_args(argv)
    if args.results:
        lines = [line for path in args.results for line in Path(path).read_text().splitlines() if line.startswith("{")]
        merged: dict[int, dict[str, Any]] = {}
        for line in lines:
            r = json.loads(line)
            merged.setdefault(r["world"], {}).update(r)
        results = [merged[w] for w in sorted(merged)]
        fits = {key: _fit(results, key) for key in PLOTTED}
        print("log-log exponents (figure ~ W^k): " + ", ".join(f"{k}={v:.2f}" for k, v in fits.items() if v is not None))
        if args.plot:
            plot(results, args.plot)
        return 0
    if any(w < 2 or w % RANKS_PER_NODE for w in args.world):
        raise SystemExit(f"--world expects multiples of {RANKS_PER_NODE} (ranks per node); got {args.world}")
    threading.stack_size(512 * 1024)  # thousands of watchdog threads
    # Each rank's report is read from what it published; thousands of them on stderr would drown the figures.
    logging.getLogger("hybridshard").setLevel(logging.CRITICAL + 1)
    results = []
    for world in args.world:
        result = run(world, args.fault_seconds, args.healthy_seconds, not args.no_faults, args.layout, args.processes,
                     not args.no_groups)
        results.append(result)
        print(json.dumps(result), flush=True)
    for world in (1_000, 10_000, 100_000):
        print(f"step check model at W={world}: " + json.dumps(step_check_model(world)))
    if len(results) > 1:
        fits = {key: _fit(results, key) for key in PLOTTED}
        print("log-log exponents (figure ~ W^k): " + ", ".join(f"{k}={v:.2f}" for k, v in fits.items() if v is not None))
    if args.plot:
        plot(results, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(main())
