"""Bus bandwidth of every shard group and replicate group, with nccl-tests' definitions.

[Note: bus bandwidth]
For a collective over ``n`` ranks moving a message of ``size`` bytes in ``t`` seconds,
``algbw = size / t``. ``busbw`` rescales it to what each rank's link carried, so numbers from groups
of different sizes compare with each other and with the hardware's peak:

- all-gather, reduce-scatter: ``busbw = algbw * (n - 1) / n``; ``size`` is the full (gathered /
  unreduced) buffer, i.e. ``n`` times one rank's shard.
- all-reduce: ``busbw = algbw * 2 (n - 1) / n``; ``size`` is the buffer every rank holds.

Shard groups run all-gather and reduce-scatter, replicate groups all-reduce: what hybrid sharding
does each step. All groups of one kind run at the same time, as they do in training, and a group's
time is that of its slowest member. A group of one rank moves nothing and has no bandwidth.
"""

from __future__ import annotations

import logging
import statistics
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch
import torch.distributed as dist

from hybridshard.comm_bytes import ring_factor

logger = logging.getLogger(__name__)

__all__ = ["KINDS", "BandwidthRow", "BandwidthReport", "bus_bandwidth", "measure_bandwidth", "DEFAULT_SIZES"]

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
DEFAULT_SIZES = (1 << 16, 1 << 20, 1 << 24)
SLOW_FACTOR = 2.0
_BAR_WIDTH = 30
# Newer torch names the flat-tensor collectives *_single and deprecates the older names.
_ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def bus_bandwidth(kind: str, algbw: float, n: int) -> float:
    """Bus bandwidth from algorithm bandwidth; see [Note: bus bandwidth]."""
    if kind not in KINDS:
        raise ValueError(f"collective must be one of {KINDS}, found {kind!r}")
    return algbw * ring_factor(kind, n)


def _human_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:g} {unit}"
    return f"{n} B"


@dataclass(frozen=True)
class BandwidthRow:
    """One collective on one group at one message size."""

    kind: str
    group_index: int
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]
    size_bytes: int
    time_s: float | None
    """Mean time per call of the group's slowest member; ``None`` for a one-rank group."""

    @property
    def algbw_gbps(self) -> float | None:
        return None if not self.time_s else self.size_bytes / self.time_s / 1e9

    @property
    def busbw_gbps(self) -> float | None:
        alg = self.algbw_gbps
        return None if alg is None else bus_bandwidth(self.kind, alg, len(self.ranks))

    @property
    def group_name(self) -> str:
        return f"{'shard' if self.kind != 'all_reduce' else 'replicate'} group {self.group_index}"

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "group_index": self.group_index, "ranks": list(self.ranks),
                "hosts": list(self.hosts), "size_bytes": self.size_bytes, "time_s": self.time_s,
                "algbw_gbps": self.algbw_gbps, "busbw_gbps": self.busbw_gbps}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BandwidthRow":
        return cls(kind=d["kind"], group_index=int(d["group_index"]), ranks=tuple(d["ranks"]),
                   hosts=tuple(d["hosts"]), size_bytes=int(d["size_bytes"]), time_s=d.get("time_s"))


@dataclass(frozen=True)
class BandwidthReport:
    """Every row of a measurement, plus how it was taken."""

    rows: tuple[BandwidthRow, ...]
    iters: int
    backend: str
    device: str

    @property
    def warnings(self) -> list[str]:
        """Groups (and hosts of multi-host groups) more than 2x slower than the median of their kind,
        judged at the largest message size."""
        out: list[str] = []
        for kind in KINDS:
            rows = [r for r in self.rows if r.kind == kind and r.busbw_gbps is not None]
            if len(rows) < 2:
                continue
            largest = max(r.size_bytes for r in rows)
            rows = [r for r in rows if r.size_bytes == largest]
            median = statistics.median(r.busbw_gbps for r in rows)
            for r in rows:
                if r.busbw_gbps * SLOW_FACTOR < median:
                    out.append(
                        f"{kind} on {r.group_name} (ranks {list(r.ranks)}, hosts {', '.join(sorted(set(r.hosts)))}): "
                        f"bus bandwidth {r.busbw_gbps:.3g} GB/s is {median / r.busbw_gbps:.1f}x below the median "
                        f"{median:.3g} GB/s of {len(rows)} {kind} groups at {_human_bytes(largest)}"
                    )
            by_host: dict[str, list[float]] = {}
            for r in rows:
                if len(set(r.hosts)) > 1:
                    for h in set(r.hosts):
                        by_host.setdefault(h, []).append(r.busbw_gbps)
            if len(by_host) >= 2:
                host_median = {h: statistics.median(v) for h, v in by_host.items()}
                overall = statistics.median(host_median.values())
                for h, v in sorted(host_median.items()):
                    if v * SLOW_FACTOR < overall:
                        out.append(f"host {h}: {kind} groups through it reach {v:.3g} GB/s, "
                                   f"{overall / v:.1f}x below the median {overall:.3g} GB/s of all hosts")
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"iters": self.iters, "backend": self.backend, "device": self.device,
                "rows": [r.to_dict() for r in self.rows], "warnings": self.warnings}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "BandwidthReport":
        return cls(rows=tuple(BandwidthRow.from_dict(r) for r in d["rows"]), iters=int(d["iters"]),
                   backend=d["backend"], device=d["device"])

    def table(self) -> str:
        head = ("collective", "group", "ranks", "hosts", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)")
        body = []
        for r in self.rows:
            fmt = (lambda v: "n/a" if v is None else f"{v:.3f}")
            body.append((r.kind, r.group_name, ",".join(map(str, r.ranks)), ",".join(sorted(set(r.hosts))),
                         _human_bytes(r.size_bytes), "n/a" if r.time_s is None else f"{r.time_s * 1e6:.1f}",
                         fmt(r.algbw_gbps), fmt(r.busbw_gbps)))
        widths = [max(len(str(x)) for x in col) for col in zip(head, *body)]
        lines = ["  ".join(str(x).ljust(w) for x, w in zip(line, widths)).rstrip() for line in (head, *body)]
        lines.insert(1, "  ".join("-" * w for w in widths))
        lines.append(f"({self.iters} iterations per size, {self.backend} on {self.device}; "
                     "busbw as nccl-tests defines it: see docs/launching.md)")
        return "\n".join(lines)


class _Progress:
    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled

    def step(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        filled = _BAR_WIDTH * self.done // self.total
        bar = f"bandwidth [{'#' * filled}{'.' * (_BAR_WIDTH - filled)}] {self.done}/{self.total} {label}"
        if sys.stderr.isatty():  # redraw in place; elsewhere (logs, local-cluster) one line per step
            sys.stderr.write(f"\r{bar:<70}" + ("\n" if self.done == self.total else ""))
        else:
            sys.stderr.write(bar + "\n")
        sys.stderr.flush()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _time_one(kind: str, group, n: int, size_bytes: int, iters: int, device: torch.device) -> tuple[int, float]:
    """Run one collective ``iters`` times after a warm-up; return (actual size in bytes, mean seconds)."""
    elem = 4  # float32
    if kind == "all_reduce":
        buf = torch.ones(max(1, size_bytes // elem), device=device)
        call, size = (lambda: dist.all_reduce(buf, group=group)), buf.numel() * elem
    else:
        shard_numel = max(1, size_bytes // (elem * n))
        small = torch.ones(shard_numel, device=device)
        big = torch.empty(shard_numel * n, device=device)
        if kind == "all_gather":
            call = lambda: _ALL_GATHER(big, small, group=group)  # noqa: E731
        else:
            call = lambda: _REDUCE_SCATTER(small, big, group=group)  # noqa: E731
        size = shard_numel * n * elem
    call()
    _sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        call()
    _sync(device)
    return size, (time.perf_counter() - start) / iters


def _host_names(groups) -> list[str]:
    cluster = getattr(groups, "cluster", None)
    world = dist.get_world_size()
    if cluster is not None:
        return [cluster.node_of(r).name for r in range(world)]
    from hybridshard.topology.probe import node_name

    names: list[Any] = [None] * world
    dist.all_gather_object(names, node_name())
    return [str(n) for n in names]


def measure_bandwidth(
    groups,
    *,
    sizes_bytes: Sequence[int] = DEFAULT_SIZES,
    iters: int = 5,
    device: torch.device | str | None = None,
    progress: bool = False,
) -> BandwidthReport:
    """Measure every group of ``groups`` (a ``ShardGroups``); collective over the default group.

    Every rank must call it with the same arguments; every rank gets the whole report.
    """
    if not dist.is_initialized():
        raise RuntimeError("measure_bandwidth needs an initialised default process group (run under torchrun)")
    if not sizes_bytes or any(int(s) < 4 for s in sizes_bytes):
        raise ValueError(f"sizes_bytes must be a non-empty list of sizes >= 4 bytes, found {list(sizes_bytes)}")
    if iters < 1:
        raise ValueError(f"iters must be >= 1, found {iters}")
    plan = groups.plan
    rank = dist.get_rank()
    if device is None:
        device = getattr(groups, "device", None) or (
            torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu"))
    device = torch.device(device)
    replicate_index, shard_index = plan.coords(rank)
    mine = {"all_gather": (groups.shard, replicate_index, plan.shard_groups[replicate_index]),
            "reduce_scatter": (groups.shard, replicate_index, plan.shard_groups[replicate_index]),
            "all_reduce": (groups.replicate, shard_index, plan.replicate_groups[shard_index])}
    bar = _Progress(len(KINDS) * len(sizes_bytes), progress and rank == 0)
    results = []
    for kind in KINDS:
        group, index, members = mine[kind]
        for size in sizes_bytes:
            dist.barrier()
            if len(members) > 1:
                actual, secs = _time_one(kind, group, len(members), int(size), iters, device)
                results.append((kind, index, int(size), actual, secs))
            else:
                results.append((kind, index, int(size), int(size), None))
            bar.step(f"{kind} {_human_bytes(int(size))}")
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, results)
    hosts = _host_names(groups)
    slowest: dict[tuple[str, int, int], tuple[int, float | None]] = {}
    for per_rank in gathered:
        for kind, index, requested, actual, secs in per_rank:
            key = (kind, index, requested)
            prev = slowest.get(key)
            worst = secs if prev is None or prev[1] is None or secs is None else max(prev[1], secs)
            slowest[key] = (actual, worst)
    rows = []
    for kind in KINDS:
        all_groups = plan.replicate_groups if kind == "all_reduce" else plan.shard_groups
        for index, members in enumerate(all_groups):
            for size in sizes_bytes:
                actual, secs = slowest[(kind, index, int(size))]
                rows.append(BandwidthRow(kind=kind, group_index=index, ranks=tuple(members),
                                         hosts=tuple(hosts[r] for r in members), size_bytes=actual, time_s=secs))
    report = BandwidthReport(rows=tuple(rows), iters=iters, backend=str(dist.get_backend()), device=str(device))
    for w in report.warnings:
        logger.debug("bandwidth: %s", w)
    return report
