"""What is slow: every rank's timing summary in, a verdict attributed by topology out (pure; no process group).

[Note: straggler verdicts]
A synchronous collective evens out every rank's step, and the slow rank is the one whose collectives
look *fastest* (it arrives last and waits least). So the verdicts read two figures per rank, never
the step time alone: its *compute* (the step minus what it was blocked on collectives; see
[Note: step timing]) and, per collective kind and group, the *transfer*: the time of the group's
member that waited least (they all finish together), the others' excess being their wait.

* **rank**: its compute stands out from the other ranks' (robustly: above ``RATIO`` x their median
  and ``Z`` scaled MADs above it); **node**: every rank of a node of two or more ranks does;
* **link**: among the instances of one group (the shard groups of each node, the rack groups), those
  with one node are slower than the rest, and than their own baseline, while the others are not and
  that node computes normally: the node's link (its NIC); when every instance crosses every node,
  none can be blamed: "the network between nodes";
* **racks**: against each group's own earlier transfer (its baseline), every instance that crosses
  racks is slower and none inside a rack is: the spine or the racks' uplinks;
* **balanced**: no one stands out, and every rank's step is ``RATIO`` x its own baseline or more.

A verdict is *active* once the same (kind, subject) was found in ``PERSIST`` consecutive reports, and
is logged when it becomes active or clears: once, not every report. Baselines are the medians of the
last reports that found nothing at all, so a slowdown never becomes its own baseline.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

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

    def to_json(self) -> dict[str, Any]:
        return {"rank": self.rank, "node": self.node, "rack": self.rack, "nic": self.nic, "steps": self.steps,
                "step_s": self.step_s, "compute_s": self.compute_s,
                "comm": {k: [g.seconds, list(g.members)] for k, g in self.comm.items()}}

    @classmethod
    def from_json(cls, d: Mapping[str, Any]) -> "RankSummary":
        comm = {k: GroupTime(float(v[0]), tuple(int(m) for m in v[1])) for k, v in d.get("comm", {}).items()}
        return cls(int(d["rank"]), str(d["node"]), str(d.get("rack", "")), str(d.get("nic", "")),
                   int(d.get("steps", 0)), float(d["step_s"]), float(d["compute_s"]), comm)


@dataclass(frozen=True)
class Verdict:
    """One finding, with its evidence and what to do."""

    kind: str
    """``"rank"``, ``"node"``, ``"link"``, ``"racks"`` or ``"balanced"``."""
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

    @property
    def key(self) -> tuple[str, str]:
        return self.kind, self.subject

    def text(self) -> str:
        return (f"slow {self.kind}: {self.subject}: {self.group} {self.seconds * 1e3:.2f} ms a step, "
                f"{self.ratio:.2f}x the {'baseline' if self.kind in ('racks', 'balanced') else 'rest'} "
                f"({self.reference_s * 1e3:.2f} ms); {self.action}")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "subject": self.subject, "group": self.group, "seconds": self.seconds,
                "reference_s": self.reference_s, "ratio": self.ratio, "action": self.action,
                "ranks": list(self.ranks), "nodes": list(self.nodes)}


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
    return out


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


def _links(summaries, by_rank, node_of, busy, baselines, ranks_of) -> list[Verdict]:
    """Instances of one group compared with each other: the one node whose instances are all slower
    than every instance without it (min of its instances above the others' median by RATIO, Z MADs)."""
    per_key: dict[str, dict[tuple[int, ...], float]] = {}
    for (key, members), t in transfers(summaries).items():
        per_key.setdefault(key, {})[members] = t
    verdicts: list[Verdict] = []
    named: set[str] = set()
    for key, inst in sorted(per_key.items()):
        nodes_in = {m: {node_of.get(r, "?") for r in m} for m in inst}
        found = []
        for node in sorted(ranks_of):
            with_it = [t for m, t in inst.items() if node in nodes_in[m]]
            without = [t for m, t in inst.items() if node not in nodes_in[m]]
            if not (with_it and without and _stands_out(min(with_it), without)[0]):
                continue
            # ... and they got slower than they were (a link slow from the start is the bandwidth
            # probe's to find: hybridshard topo --bandwidth), while the others did not.
            got_slower = {m: _slower(t, baselines.get((key, m))) for m, t in inst.items()}
            if all(got_slower[m] for m in inst if node in nodes_in[m]) and \
                    not any(got_slower[m] for m in inst if node not in nodes_in[m]):
                found.append((node, statistics.median(with_it), statistics.median(without)))
        if len(found) != 1:
            continue  # none, or several nodes to blame: not one link
        node, seconds, ref = found[0]
        if node in named or any(r in busy for r in ranks_of.get(node, [])):
            continue  # a slow node's transfers are slow because its compute is: named above
        named.add(node)
        nic = next((by_rank[r].nic for r in ranks_of.get(node, []) if by_rank[r].nic), "")
        where = f"{node}'s link" + (f" ({nic})" if nic else "")
        verdicts.append(Verdict("link", where, key, seconds, ref, seconds / ref if ref else float("inf"),
                                f"{node} computes normally but its transfers on {key.split('@')[1]} are slow: check "
                                f"its NIC{' ' + nic if nic else ''} (errors, speed, cable) and its switch port; "
                                "hybridshard topo --bandwidth measures it",
                                tuple(sorted(ranks_of.get(node, []))), (node,)))
    return verdicts


def _racks(summaries, by_rank, baselines) -> list[Verdict]:
    """Every instance slower than its own baseline: across racks only (the spine), or every node."""
    cross_rack, in_rack, cross_node, in_node = [], [], [], []
    for (key, members), t in transfers(summaries).items():
        base = baselines.get((key, members))
        if base is None or not all(r in by_rank for r in members):
            continue
        racks = {by_rank[r].rack for r in members}
        nodes = {by_rank[r].node for r in members}
        slower = _slower(t, base)
        (cross_rack if len(racks) > 1 and "" not in racks else in_rack).append((slower, key, t, base, members))
        (cross_node if len(nodes) > 1 else in_node).append((slower, key, t, base, members))
    verdicts = []
    if cross_rack and all(s for s, *_ in cross_rack) and in_rack and not any(s for s, *_ in in_rack):
        racks = sorted({by_rank[r].rack for *_, members in cross_rack for r in members})
        verdicts.append(_level_verdict("racks", "racks " + ", ".join(racks), cross_rack,
                                       "every hop across racks is slow and none inside a rack: check the spine "
                                       "(its links, congestion from other jobs) and the racks' uplinks"))
    elif cross_node and all(s for s, *_ in cross_node) and not any(s for s, *_ in in_node):
        verdicts.append(_level_verdict("link", "the network between nodes", cross_node,
                                       "every transfer between nodes is slow and none inside one: with groups "
                                       "that span every node no one NIC can be named; hybridshard topo "
                                       "--bandwidth measures each"))
    return verdicts


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
        return {k: statistics.median(v) for k, v in self._history.items() if v}

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
