"""The control plane at W ranks on one machine: the project's real heartbeat, watchdog and fault-check
code, one thread per rank, one real TCPStore.

    python benchmarks/control_plane_scale.py --world 64 256 1024 4096

Prints one JSON line per W (lines starting with ``{``; everything else is commentary) and, with
``--plot PATH`` and matplotlib installed, a log-log plot of each figure against W.

What runs for real, per simulated rank: its own :class:`~hybridshard.runtime.faults.rank_state.ControlPlane`
with its own TCPStore client (libuv server, one per W), its watchdog thread (heartbeats, the fault
check of :mod:`hybridshard.runtime.faults`, the hang report) and the registry of collectives in
flight. What is simulated: a collective is a registered entry, never a transfer (no model compute, no
process group); a rank's death is its watchdog thread stopping with its store connection left open,
as a frozen process's (threads cannot be SIGKILLed, and a SIGKILL'd process on gloo fails its peers'
collectives at once, the easy case); rank 0's checkpoint stall is rank 0 outside any collective
while every other rank's collective waits on it.

Timing under the GIL on 2 cores measures the harness too. Store operations and bytes are counted
exactly (a counting wrapper around each rank's client); times are wall clock, and each phase reports
``lag_ms``: how late a thread that sleeps 50 ms wakes, worst case over the phase, the delay every
simulated rank's thread saw on top of the control plane's own time. Init and checkpoint metadata are
the bytes of the real payloads (each rank's probe from the NVML fixtures, 8 ranks a node) that the
object messages of :func:`~hybridshard.topology.summary.gather_summary` (its gather tree, counted per
receiving rank; for comparison, the flat gather through rank 0 and the ``all_gather_object`` before
it) move, and the real packing, assembly and planning code timed once; the messages are not sent and
process groups are not created (neither ``split_group`` nor ``new_group`` is measured).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import logging
import math
import os
import pickle
import re
import sys
import threading
import time
import uuid
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from hybridshard.runtime.faults import peers, watchdog
from hybridshard.runtime.faults.rank_state import ControlPlane, bound

FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "fixtures" / "nvml" / "dgx_h100_nvswitch.json"
RANKS_PER_NODE = 8
STALL_FACTOR = 1.5
"""The stall is 90 s against the default HYBRIDSHARD_FAULT_SECONDS of 60: scaled alike."""
ALPHA_S = 5e-6
"""Latency of one message between nodes (the α of the α-β model)."""
BETA_S_PER_BYTE = 1 / 25e9
"""Seconds per byte at 25 GB/s (one 200 Gb/s NIC per GPU)."""


class CountingStore:
    """A store client that counts its operations and bytes (exact, whatever the timing)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.ops, self.reads, self.sent, self.received = inner, 0, 0, 0, 0
        self.frozen = False
        """A killed rank's: its writes never happen, its reads fail (so its threads stop at once)."""

    def _alive(self) -> None:
        if self.frozen:
            raise RuntimeError("this simulated rank was killed")

    def set(self, key: str, value: bytes) -> None:
        self._alive()
        self.ops += 1
        self.sent += len(key) + len(value)
        self.inner.set(key, value)

    def check(self, keys: list[str]) -> bool:
        self._alive()
        self.ops += 1
        self.reads += 1
        self.sent += sum(map(len, keys))
        return self.inner.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        self._alive()
        values = self.inner.multi_get(keys)
        self.ops += 1
        self.reads += 1
        self.sent += sum(map(len, keys))
        self.received += sum(map(len, values))
        return values

    def get(self, key: str) -> bytes:
        self._alive()
        value = self.inner.get(key)
        self.ops += 1
        self.reads += 1
        self.sent += len(key)
        self.received += len(value)
        return value

    def add(self, key: str, n: int) -> int:
        self._alive()
        self.ops += 1
        self.reads += 1
        self.sent += len(key) + 8
        self.received += 8
        return self.inner.add(key, n)


class Lag:
    """How late a sleeping thread wakes: the harness's own share of every timing (GIL, 2 cores)."""

    def __init__(self) -> None:
        self.worst, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            t = time.monotonic()
            time.sleep(0.05)
            self.worst = max(self.worst, time.monotonic() - t - 0.05)

    def reset(self) -> float:
        worst, self.worst = self.worst, 0.0
        return worst

    def stop(self) -> None:
        self._stop.set()


class Job:
    """W ranks: one plane, one store client and one watchdog thread each."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.server = dist.TCPStore("127.0.0.1", 0, is_master=True, use_libuv=True, wait_for_workers=False,
                                    timeout=timedelta(seconds=60))
        self.stopped: dict[int, tuple[float, str]] = {}
        # [Note: connecting in parallel] A client's connect now and then takes 5 s here (a retried SYN,
        # seen with either server): thousands of them one after another would take many minutes.
        with concurrent.futures.ThreadPoolExecutor(64) as pool:
            clients = list(pool.map(lambda _: dist.TCPStore("127.0.0.1", self.server.port, is_master=False,
                                                            use_libuv=True, timeout=timedelta(seconds=60)),
                                    range(world)))
        self.planes: list[ControlPlane] = []
        for rank, client in enumerate(clients):
            plane = ControlPlane(CountingStore(client), rank, world)
            plane.is_ready = lambda: True
            plane.on_stop = self._on_stop(rank, plane)
            self.planes.append(plane)

    def _on_stop(self, rank: int, plane: ControlPlane) -> Any:
        def stop(status: int) -> None:  # what errors.stop_now does to a process: its report is its last word
            text = (plane.final or {}).get("text", "")
            self.stopped[rank] = (time.monotonic(), text)
            plane.stop.set()
        return stop

    def start(self) -> None:
        for plane in self.planes:
            with bound(plane):
                watchdog.start()

    def counts(self) -> tuple[int, int, int]:
        stores = [p.found["store"] for p in self.planes]
        return sum(s.ops for s in stores), sum(s.reads for s in stores), sum(s.sent + s.received for s in stores)

    def begin_all(self, ranks: range) -> dict[int, int]:
        tokens = {}
        for r in ranks:
            with bound(self.planes[r]):
                tokens[r] = watchdog.begin("all_reduce", "world", range(self.world), 1 << 20)
        return tokens

    def end_all(self, tokens: dict[int, int]) -> None:
        for r, token in tokens.items():
            with bound(self.planes[r]):
                watchdog.end(token)

    def close(self) -> None:
        for plane in self.planes:
            plane.stop.set()
        for plane in self.planes:
            if plane.thread is not None:
                plane.thread.join(timeout=10)


def _set_limits(fault_s: float | None) -> None:
    if fault_s is None:
        os.environ.pop("HYBRIDSHARD_FAULT_SECONDS", None)
        os.environ.pop("HYBRIDSHARD_HANG_SECONDS", None)
    else:
        os.environ["HYBRIDSHARD_FAULT_SECONDS"] = str(fault_s)
        os.environ["HYBRIDSHARD_HANG_SECONDS"] = str(5 * fault_s)  # 300 s against 60 s, scaled alike


def healthy(job: Job, seconds: float, lag: Lag) -> dict[str, float]:
    """Steps of a healthy job: every rank in collectives of half a second, one after the other, nobody
    stuck. The heartbeats are then the only store traffic; a rank that has waited in one collective for
    a second or more also reads the count of kept causes once a poll (see [Note: keeping the causes]
    in :mod:`hybridshard.runtime.faults.causes`), which a stall phase shows, not this one."""
    _set_limits(None)
    ops0, _, bytes0 = job.counts()
    lag.reset()
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        tokens = job.begin_all(range(job.world))
        time.sleep(min(0.5, max(0.0, end - time.monotonic())))
        job.end_all(tokens)
    ops1, _, bytes1 = job.counts()
    per = job.world * seconds
    return {"store_ops_per_rank_per_s": (ops1 - ops0) / per, "store_bytes_per_rank_per_s": (bytes1 - bytes0) / per,
            "healthy_lag_ms": 1e3 * lag.reset()}


def stall(job: Job, fault_s: float, lag: Lag) -> dict[str, float]:
    """Rank 0 outside any collective for STALL_FACTOR x the fault limit, every other rank waiting on it."""
    _set_limits(fault_s)
    tokens = job.begin_all(range(1, job.world))
    ops0, reads0, bytes0 = job.counts()
    lag.reset()
    time.sleep(STALL_FACTOR * fault_s)
    deadline = time.monotonic() + 60  # checks that began still finish (the harness may be late)
    while time.monotonic() < deadline and any(p.override is not None for p in job.planes):
        time.sleep(0.1)
    checks = sum(1 for p in job.planes for e in list(p.in_flight.values()) if e.checked)
    job.end_all(tokens)
    ops1, reads1, bytes1 = job.counts()
    checks = max(checks, 1)
    return {"false_reports": len(job.stopped), "stall_checks": checks,
            "store_ops_per_check_per_rank": (reads1 - reads0) / checks + 1,  # + the ask's own heartbeat
            "store_bytes_per_check_per_rank": (bytes1 - bytes0) / checks, "stall_lag_ms": 1e3 * lag.reset(),
            "stall_total_ops": ops1 - ops0}


def detect(job: Job, fault_s: float, lag: Lag, victim: int) -> dict[str, float]:
    """Every rank in a collective; the victim's threads stop at t0. Time until every survivor named it."""
    _set_limits(fault_s)
    job.stopped.clear()
    tokens = job.begin_all(range(job.world))
    t0 = time.monotonic()
    job.planes[victim].found["store"].frozen = True
    job.planes[victim].stop.set()
    lag.reset()
    survivors = [r for r in range(job.world) if r != victim]
    deadline = t0 + fault_s + 8 * peers.REPORT_SECONDS + 60
    while time.monotonic() < deadline and len(job.stopped) < len(survivors):
        time.sleep(0.1)
    named = re.compile(rf"\brank {victim} was lost|\branks [0-9, ]*\b{victim}\b[0-9, ]* were lost")
    right = [r for r in survivors if r in job.stopped and named.search(job.stopped[r][1])]
    last = max((job.stopped[r][0] for r in right), default=float("nan"))
    job.end_all(tokens)
    wrong = sorted({job.stopped[r][1].split(": ", 1)[-1][:120] for r in survivors if r in job.stopped and r not in right})
    for text in wrong[:3]:
        print(f"W={job.world}: a survivor did not name rank {victim} alone: {text}")
    return {"detected": len(right), "survivors": len(survivors), "reported": len(job.stopped), "detect_s": last - t0,
            "detect_after_check_s": last - t0 - fault_s, "detect_lag_ms": 1e3 * lag.reset()}


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


def init_and_checkpoint(world: int, layout: str = "block") -> dict[str, float]:
    """Bytes each rank receives in :func:`hybridshard.topology.summary.gather_summary` (the gather tree:
    parts to block leaders, their keys to rank 0, its choice of senders back, each node probe once to
    its leader, one blob of parts and node probes a block to rank 0, the view to all), from the real
    payloads, per rank; and the time through it on its critical path: a rank's part, rank 0's choice,
    the slowest leader's blob, rank 0's assembly, a rank's planning."""
    from hybridshard.topology import summary
    from hybridshard.topology.planner import plan_groups

    probes = _probes(world, layout)
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
    ckpt = _gathered_bytes(nodes_of) + _gathered_bytes([1 << 40] * world)  # node names, then bytes written
    members = sorted(set(range(world)) - {b[0] for b in tree})
    return {"init_s": init_s, "init_ranks_per_block": len(tree[0]),
            "init_bytes_per_rank": max((received[r] for r in members), default=0),
            "init_bytes_leader": max(received[r] for r in leaders), "init_bytes_rank0": received[0],
            "init_bytes_max_rank": max(received), "init_bytes_rank0_flat": rank0_flat,
            "init_bytes_per_rank_all_gather": _gathered_bytes([p.to_dict() for p in probes]),
            "ckpt_meta_bytes_per_rank": ckpt}


def step_check_model(world: int) -> dict[str, float]:
    """Seconds per step check under the α-β model: the check before (a ring all-gather of 6 int64 from
    every rank: W-1 steps, each one message) against the check now (an all-reduce of a fixed 12 int64;
    a tree: 2 log2 W steps, up then down; a ring, for comparison: 2 (W-1) steps). See docs/scale.md."""
    steps = math.ceil(math.log2(world))
    return {"step_check_bytes_per_rank": 96, "step_check_bytes_per_rank_all_gather": 48 * world,
            "step_check_allgather_ring_s": (world - 1) * (ALPHA_S + 48 * BETA_S_PER_BYTE),
            "step_check_tree_s": 2 * steps * (ALPHA_S + 96 * BETA_S_PER_BYTE),
            "step_check_allreduce_ring_s": 2 * (world - 1) * (ALPHA_S + 96 / world * BETA_S_PER_BYTE)}


def run(world: int, fault_s: float, healthy_s: float, faults: bool, layout: str = "block") -> dict[str, Any]:
    out: dict[str, Any] = {"world": world, "layout": layout, "fault_seconds": fault_s}
    out.update(init_and_checkpoint(world, layout))
    out.update(step_check_model(world))
    if not faults:
        return out
    lag = Lag()
    t = time.monotonic()
    job = Job(world)
    job.start()
    out["start_s"] = time.monotonic() - t
    # The phases set the fault limits in os.environ; a caller's own (a test run in the same process,
    # whose later subprocesses inherit them) are put back after.
    saved = {k: os.environ.get(k) for k in ("HYBRIDSHARD_FAULT_SECONDS", "HYBRIDSHARD_HANG_SECONDS")}
    try:
        time.sleep(2.0)  # every rank beat once
        out.update(healthy(job, healthy_s, lag))
        out.update(stall(job, fault_s, lag))
        out.update(detect(job, fault_s, lag, victim=world // 2 + 1))
    finally:
        job.close()
        lag.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return out


def _fit(results: list[dict[str, Any]], key: str) -> float | None:
    pts = [(math.log(r["world"]), math.log(r[key])) for r in results
           if isinstance(r.get(key), (int, float)) and r[key] > 0]
    if len(pts) < 2:
        return None
    mx, my = sum(x for x, _ in pts) / len(pts), sum(y for _, y in pts) / len(pts)
    den = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / den if den else None


PLOTTED = ("init_s", "init_bytes_per_rank", "init_bytes_max_rank", "init_bytes_rank0", "store_ops_per_rank_per_s",
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
    for key in PLOTTED:
        pts = [(w, r[key]) for w, r in zip(worlds, results) if isinstance(r.get(key), (int, float)) and r[key] > 0]
        if pts:
            ax.plot(*zip(*pts), marker="o", label=key)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("world size W (ranks, 8 per node)")
    ax.set_title("hybridshard control plane against W (benchmarks/control_plane_scale.py)")
    ax.legend(fontsize=7)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"plot written to {path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--fault-seconds", type=float,
                        default=float(os.environ.get("HYBRIDSHARD_FAULT_SECONDS", "4")),
                        help="HYBRIDSHARD_FAULT_SECONDS for the stall and death phases (the stall lasts 1.5x it)")
    parser.add_argument("--healthy-seconds", type=float, default=5.0)
    parser.add_argument("--no-faults", action="store_true", help="only the init, checkpoint and model figures")
    parser.add_argument("--layout", choices=("block", "cyclic"), default="block",
                        help="rank order of the init probes (the fault phases do not depend on it)")
    parser.add_argument("--plot", default=None, help="write a log-log PNG here (needs matplotlib)")
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
        result = run(world, args.fault_seconds, args.healthy_seconds, not args.no_faults, args.layout)
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
