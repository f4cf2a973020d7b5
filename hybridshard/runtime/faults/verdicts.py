"""What is slow: every rank's timing summary in, a verdict attributed by topology out (pure; no process group).

[Note: straggler verdicts]
A synchronous collective evens out every rank's step, and the slow rank is the one whose collectives
look *fastest* (it arrives last and waits least). So the verdicts read two figures per rank, never
the step time alone: its *compute* (the step minus what it was blocked on collectives; see
[Note: step timing]) and, per collective kind and group, the *transfer*: the time of the group's
member that waited least (they all finish together), the others' excess being their wait.

* **rank**: its compute stands out (``RATIO`` x the others' median, ``Z`` MADs); **node**: a node's all do;
* **link**: against each group instance's own earlier transfer (its baseline), one node alone is
  only in instances across nodes that got slower (a two-hop reduction's rack and across-racks groups
  cross different nodes) and computes normally: its link (NIC); when every instance crosses every
  node: "the network between nodes";
* **racks**: every instance across racks got slower, those inside a rack less: the spine or uplinks;
* **balanced**: no one stands out, and every rank's step is ``RATIO`` x its own baseline or more.
Link and racks are relative: the slowdown named is ``RATIO`` x the others' median slowdown or more
(load on the machine, or a collective's wait timed with its transfer on CPU, slows all alike).

A verdict is *active* once the same (kind, subject) was found in ``PERSIST`` consecutive reports, and
is logged when it becomes active or clears: once, not every report. Baselines are the medians of the
last reports that found nothing at all, so a slowdown never becomes its own baseline.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

from hybridshard.runtime.faults.gpu_state import GpuState, with_gpu_evidence
from hybridshard.runtime.faults.replica_groups import name_replica_groups

__all__ = ["PERSIST", "RATIO", "GroupTime", "RankSummary", "Tracker", "Verdict", "analyse", "mad"]

RATIO = 1.3
"""A figure this many times the others' median (or its own baseline) or more is a candidate."""
Z = 4.0
"""... and this many scaled MADs above the others' median (with ``MAD_MIN`` others or more)."""
MAD_MIN = 4
FLOOR_S = 5e-4
"""... and at least this many seconds above it (timer noise on tiny steps)."""
PERSIST = 2
"""Consecutive reports a verdict must be found in before it is active."""
HISTORY = 5
MIN_HEALTHY = 3
"""Healthy reports a baseline needs before anything is compared with it."""
"""Healthy reports a baseline is the median of."""


@dataclass(frozen=True)
class GroupTime:
    """One collective kind on one group, for one rank: seconds per step (median), and the group's members."""

    seconds: float
    members: tuple[int, ...]


@dataclass(frozen=True)
class RankSummary:
    """One rank over one report's steps (medians per step)."""

    rank: int
    node: str
    rack: str = ""
    """Its network path, ``"pod0/rack1"`` (``HYBRIDSHARD_NETWORK_PATH``), or empty when unknown."""
    nic: str = ""
    steps: int = 0
    step_s: float = 0.0
    compute_s: float = 0.0
    comm: Mapping[str, GroupTime] = field(default_factory=dict)
    gpu: GpuState | None = None
    """Its GPU's clocks, temperature and clocks-event reasons at the report's end (CUDA ranks where NVML answers)."""
    replica_group: str = ""
    """Its fault-tolerant replica group's id; empty without fault tolerance."""

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "rack": self.rack, "nic": self.nic, "steps": self.steps,
                "step_s": self.step_s, "compute_s": self.compute_s,
                "comm": {k: [g.seconds, list(g.members)] for k, g in self.comm.items()},
                "gpu": self.gpu.to_json() if self.gpu else None, "replica_group": self.replica_group}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RankSummary":
        comm = {k: GroupTime(float(v[0]), tuple(int(m) for m in v[1])) for k, v in d.get("comm", {}).items()}
        return cls(int(d["rank"]), str(d["node"]), str(d.get("rack", "")), str(d.get("nic", "")),
                   int(d.get("steps", 0)), float(d["step_s"]), float(d["compute_s"]), comm,
                   GpuState.from_json(d.get("gpu")), str(d.get("replica_group", "")))


@dataclass(frozen=True)
class Verdict:
    """One finding, with its evidence and what to do."""

    kind: str
    """``"rank"``, ``"node"``, ``"link"``, ``"racks"``, ``"balanced"`` or ``"replica_group"`` (fault tolerance)."""
    subject: str
    """Who: ``"rank 3 (node1)"``, ``"node1"``, ``"node1's link (eth0)"``, ``"racks pod0/r1, pod0/r2"``."""
    group: str
    """The evidence's figure: ``"compute"``, ``"step"`` or a collective ``"kind@group"``."""
    seconds: float
    """The subject's median per step."""
    reference_s: float
    """The rest's median (or the baseline's) per step."""
    ratio: float
    action: str
    ranks: tuple[int, ...] = ()
    nodes: tuple[str, ...] = ()
    reference: str = ""
    """What ``reference_s`` is, ``"rest"`` or ``"baseline"``; empty: by kind (racks, balanced: the baseline)."""

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.subject

    def text(self) -> str:
        return (f"slow {self.kind}: {self.subject}: {self.group} {self.seconds * 1e3:.2f} ms a step, "
                f"{self.ratio:.2f}x the {self.reference or ('baseline' if self.kind in ('racks', 'balanced') else 'rest')} "
                f"({self.reference_s * 1e3:.2f} ms); {self.action}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "group": self.group, "seconds": self.seconds,
                "reference_s": self.reference_s, "ratio": self.ratio, "action": self.action,
                "ranks": list(self.ranks), "nodes": list(self.nodes), "reference": self.reference}


def mad(values: Iterable[float]) -> float:
    """The median absolute deviation, scaled to a normal's standard deviation."""
    values = list(values)
    if len(values) < 2:
        return 0.0
    m = statistics.median(values)
    return 1.4826 * statistics.median(abs(v - m) for v in values)


def _stands_out(value: float, others: list[float]) -> tuple[bool, float]:
    """Whether ``value`` stands out above ``others``; and their median."""
    if not others:
        return False, value
    m = statistics.median(others)
    spread = Z * mad(others) if len(others) >= MAD_MIN else 0.0  # a MAD of three values says little
    return value > max(RATIO * m, m + spread, m + FLOOR_S), m


def _slower(value: float, base: float | None) -> bool:
    return base is not None and value > max(RATIO * base, base + FLOOR_S)


Baselines = Mapping[Any, float]
"""``("step", rank)`` / ``("compute", rank)`` / ``(key, members)`` -> seconds."""


def instances(summaries: list[RankSummary]) -> dict[tuple[str, tuple[int, ...]], dict[int, float]]:
    """``(kind@group, members)`` -> each member's seconds (the members that reported)."""
    out: dict[tuple[str, tuple[int, ...]], dict[int, float]] = {}
    for s in summaries:
        for key, g in s.comm.items():
            out.setdefault((key, g.members), {})[s.rank] = g.seconds
    return out


def transfers(summaries: list[RankSummary]) -> dict[tuple[str, tuple[int, ...]], float]:
    """Each group instance's transfer: its least-waiting member's time (see [Note: straggler verdicts])."""
    return {k: min(v.values()) for k, v in instances(summaries).items() if v}


def analyse(summaries: list[RankSummary], baselines: Baselines | None = None) -> list[Verdict]:
    """The verdicts one report supports (before persistence)."""
    baselines = baselines or {}
    by_rank = {s.rank: s for s in summaries}
    node_of = {s.rank: s.node for s in summaries}
    ranks_of: dict[str, list[int]] = {}
    for s in summaries:
        ranks_of.setdefault(s.node, []).append(s.rank)
    out = _compute_outliers(summaries, ranks_of)
    busy = {r for v in out for r in v.ranks}
    out += _links(summaries, by_rank, node_of, busy, baselines, ranks_of)
    if not out:
        out += _racks(summaries, by_rank, baselines)
    if not out:
        out += _balanced(summaries, baselines)
    return with_gpu_evidence(name_replica_groups(summaries, out, baselines, _slower), summaries)


def _compute_outliers(summaries: list[RankSummary], ranks_of: dict[str, list[int]]) -> list[Verdict]:
    compute = {s.rank: s.compute_s for s in summaries}
    slow: dict[int, float] = {}
    for r, c in compute.items():
        out, m = _stands_out(c, [v for q, v in compute.items() if q != r])
        if out:
            slow[r] = m
    if not slow or 2 * len(slow) > len(compute):  # half the job or more is no outlier
        return []
    verdicts = []
    for node, ranks in sorted(ranks_of.items()):
        mine = [r for r in ranks if r in slow]
        if not mine:
            continue
        ref = statistics.median(slow[r] for r in mine)
        seconds = statistics.median(compute[r] for r in mine)
        if len(ranks) > 1 and len(mine) == len(ranks):
            verdicts.append(Verdict("node", node, "compute", seconds, ref, seconds / ref if ref else float("inf"),
                                    f"every rank of {node} computes slowly: check the host (CPU load, memory, "
                                    "thermals, clocks: nvidia-smi -q -d PERFORMANCE), drain or replace it",
                                    tuple(sorted(mine)), (node,)))
            continue
        for r in mine:
            verdicts.append(Verdict("rank", f"rank {r} ({node})", "compute", compute[r], slow[r],
                                    compute[r] / slow[r] if slow[r] else float("inf"),
                                    f"rank {r}'s own work is slow: its data loader, its CPU (load, binding), "
                                    "its GPU (clocks, thermals: nvidia-smi -q -d PERFORMANCE,CLOCK)",
                                    (r,), (node,)))
    return verdicts


def _ratios(summaries, baselines) -> dict[tuple[str, tuple[int, ...]], tuple[float, float]]:
    """Each instance with a baseline: ``(transfer, baseline)``."""
    out = {}
    for inst, t in transfers(summaries).items():
        base = baselines.get(inst)
        if base is not None:
            out[inst] = (t, base)
    return out


def _links(summaries, by_rank, node_of, busy, baselines, ranks_of) -> list[Verdict]:
    """The one node every one of whose instances across nodes got slower than its baseline, by ``RATIO``
    times what the instances without it got slower (see [Note: straggler verdicts])."""
    rows = {inst: tb for inst, tb in _ratios(summaries, baselines).items()
            if len({node_of.get(r, "?") for r in inst[1]}) > 1}
    ratio = {inst: t / b if b else float("inf") for inst, (t, b) in rows.items()}
    found = []
    for node in sorted(ranks_of):
        mine = [inst for inst in rows if node in {node_of.get(r, "?") for r in inst[1]}]
        rest = [ratio[inst] for inst in rows if inst not in mine]
        if not mine or not rest or not all(_slower(*rows[inst]) for inst in mine):
            continue
        # Relative to the rest: see [Note: straggler verdicts].
        if min(ratio[inst] for inst in mine) >= RATIO * statistics.median(rest):
            found.append((node, mine))
    if len(found) != 1:
        return []  # none, or several nodes to blame: not one link
    node, mine = found[0]
    if any(r in busy for r in ranks_of.get(node, [])):
        return []  # a slow node's transfers are slow because its compute is: named above
    key, members = max(mine, key=lambda inst: ratio[inst])
    seconds = statistics.median(rows[inst][0] for inst in mine if inst[0] == key)
    others = [t for inst, (t, _) in rows.items() if inst[0] == key and inst not in mine]
    ref = statistics.median(others) if others else rows[(key, members)][1]
    nic = next((by_rank[r].nic for r in ranks_of.get(node, []) if by_rank[r].nic), "")
    where = f"{node}'s link" + (f" ({nic})" if nic else "")
    return [Verdict("link", where, key, seconds, ref, seconds / ref if ref else float("inf"),
                    f"{node} computes normally but its transfers are slow (every group it is in, e.g. "
                    f"{key.split('@')[1]}): check its NIC{' ' + nic if nic else ''} (errors, speed, cable) and its "
                    "switch port; hybridshard topo --bandwidth measures it",
                    tuple(sorted(ranks_of.get(node, []))), (node,))]


def _racks(summaries, by_rank, baselines) -> list[Verdict]:
    """Every instance across racks slower than its own baseline, by ``RATIO`` times what those inside a
    rack got slower: the spine; or every instance across nodes so, against those inside a node."""
    cross_rack, in_rack, cross_node, in_node = [], [], [], []
    for (key, members), (t, base) in _ratios(summaries, baselines).items():
        if not all(r in by_rank for r in members):
            continue
        racks = {by_rank[r].rack for r in members}
        nodes = {by_rank[r].node for r in members}
        row = (_slower(t, base), key, t, base, members)
        (cross_rack if len(racks) > 1 and "" not in racks else in_rack).append(row)
        (cross_node if len(nodes) > 1 else in_node).append(row)
    verdicts = []
    if _apart(cross_rack, in_rack):
        racks = sorted({by_rank[r].rack for *_, members in cross_rack for r in members})
        verdicts.append(_level_verdict("racks", "racks " + ", ".join(racks), cross_rack,
                                       "every hop across racks got slower, those inside a rack much less: check the spine "
                                       "(its links, congestion from other jobs) and the racks' uplinks"))
    elif _apart(cross_node, in_node):
        verdicts.append(_level_verdict("link", "the network between nodes", cross_node,
                                       "every transfer between nodes got slower, those inside one much less: with groups "
                                       "that span every node no one NIC can be named; hybridshard topo "
                                       "--bandwidth measures each"))
    return verdicts


def _apart(slow: list, normal: list) -> bool:
    """Every row of ``slow`` got slower than its baseline, by ``RATIO`` x the median of ``normal``'s slowdowns
    or more (see [Note: straggler verdicts])."""
    if not slow or not normal or not all(s for s, *_ in slow):
        return False
    normal_ratio = statistics.median(t / b for _, _, t, b, _ in normal if b)
    return min(t / b for _, _, t, b, _ in slow) >= RATIO * normal_ratio


def _level_verdict(kind: str, subject: str, rows: list, action: str) -> Verdict:
    worst = max(rows, key=lambda row: row[2] / row[3] if row[3] else 0.0)
    ratio = statistics.median(t / b for _, _, t, b, _ in rows if b)
    return Verdict(kind, subject, worst[1], statistics.median(t for _, _, t, _, _ in rows),
                   statistics.median(b for _, _, _, b, _ in rows), ratio, action,
                   tuple(sorted({r for *_, m in rows for r in m})))


def _balanced(summaries: list[RankSummary], baselines: Baselines) -> list[Verdict]:
    steps = [(s.step_s, baselines.get(("step", s.rank))) for s in summaries]
    if not steps or any(b is None or not _slower(t, b) for t, b in steps):
        return []
    ratio = statistics.median(t / b for t, b in steps)
    compute = [(s.compute_s, baselines.get(("compute", s.rank))) for s in summaries]
    more_compute = all(b is not None and _slower(c, b) for c, b in compute)
    why = ("every rank computes more (data, thermals or clocks on every GPU, a change in the model or batch)"
           if more_compute else "every rank waits longer on collectives (the network, or a shared storage/data source)")
    return [Verdict("balanced", "every rank", "step", statistics.median(t for t, _ in steps),
                    statistics.median(b for _, b in steps), ratio,
                    f"{why}: compare with the first steps' figures in this file",
                    tuple(sorted(s.rank for s in summaries)))]


class Tracker:
    """Reports in, active verdicts and their changes out: persistence and baselines."""

    def __init__(self, persist: int = PERSIST) -> None:
        self.persist = persist
        self.active: dict[tuple[str, str], Verdict] = {}
        self._streak: dict[tuple[str, str], int] = {}
        self._rank_streak: dict[int, int] = {}
        self._history: dict[Any, deque[float]] = {}

    def baselines(self) -> dict[Any, float]:
        # A baseline from fewer healthy reports is one noisy window: a false link verdict was seen on it.
        return {k: statistics.median(v) for k, v in self._history.items() if len(v) >= MIN_HEALTHY}

    def update(self, summaries: list[RankSummary]) -> tuple[list[Verdict], list[str]]:
        """One report: the verdicts active after it, and one line per change (new, or cleared)."""
        found = analyse(summaries, self.baselines())
        keys = {v.key: v for v in found}
        self._streak = {k: self._streak.get(k, 0) + 1 for k in keys}
        # A slow rank's neighbours may come and go (rank one report, its node the next): a compute verdict
        # persists by its ranks, each flagged in consecutive reports, whatever the kind.
        flagged = {r for v in found if v.group == "compute" for r in v.ranks}
        self._rank_streak = {r: self._rank_streak.get(r, 0) + 1 for r in flagged}
        changes = []
        now = {k: v for k, v in keys.items()
               if (min(self._rank_streak[r] for r in v.ranks) if v.group == "compute" else self._streak[k]) >= self.persist}
        for k, v in now.items():
            if k not in self.active:
                changes.append(v.text())
        for k, v in self.active.items():
            if k not in keys:
                changes.append(f"cleared: slow {v.kind}: {v.subject}")
        # An active verdict stays active while it is still found (its streak goes on).
        self.active = now
        if not found:
            self._learn(summaries)
        return list(now.values()), changes

    def _learn(self, summaries: list[RankSummary]) -> None:
        def add(key: Any, value: float) -> None:
            self._history.setdefault(key, deque(maxlen=HISTORY)).append(value)
        for s in summaries:
            add(("step", s.rank), s.step_s)
            add(("compute", s.rank), s.compute_s)
        for key, t in transfers(summaries).items():
            add(key, t)
