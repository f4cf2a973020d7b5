"""Fault-tolerant replica groups named as such in the straggler verdicts: a pass over :func:`analyse`'s.

[Note: slow replica groups]
With fault tolerance on (:mod:`hybridshard.ft`) a replica group is the unit that can be removed: the
others go on without it and it heals from a live group when it comes back. Every rank's summary
carries its group's id (``FaultTolerance.replica_id``; ``HYBRIDSHARD_REPLICA_ID`` before it exists).

* **one group in the report**: each replica group is its own torch.distributed job, so its rank 0
  judges its own ranks only, against their own baselines. A balanced slowdown there is the group's:
  when every rank computes more than its baseline the group is slow (``replica_group``); when its
  ranks wait longer while computing as before, they wait on the all-reduce across groups for a
  slower group (whose own report names itself) or on this group's link to the others;
* **several groups in one report** (summaries gathered across groups, ranks numbered apart): the
  rank, node and link verdicts on one figure whose ranks together are exactly one group's ranks
  become one verdict naming the group.

Without replica-group ids, or with some ranks lacking one, the verdicts pass unchanged.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

if TYPE_CHECKING:
    from hybridshard.runtime.faults.verdicts import RankSummary, Verdict

__all__ = ["name_replica_groups"]


def _remove(group: str, what: str) -> str:
    return (f"every rank of replica group {group} {what}: with fault tolerance the other groups go on without it: "
            f"stop its job and the lighthouse's next quorum leaves it out; restarted on a healthy node with the same "
            f"HYBRIDSHARD_REPLICA_ID it heals from a live group")


def name_replica_groups(summaries: Sequence["RankSummary"], verdicts: list["Verdict"], baselines: Mapping[Any, float],
                        slower: Callable[[float, float | None], bool]) -> list["Verdict"]:
    """The verdicts with slow replica groups named; see [Note: slow replica groups]. ``slower(value,
    baseline)``: whether a figure got slower than its baseline (the verdicts' own test)."""
    members: dict[str, list[int]] = {}
    for s in summaries:
        members.setdefault(s.replica_group, []).append(s.rank)
    if not members or "" in members:
        return verdicts
    if len(members) == 1:
        return [_one_group(next(iter(members)), summaries, v, baselines, slower) if v.kind == "balanced" else v
                for v in verdicts]
    return _several_groups(members, summaries, verdicts)


def _one_group(group: str, summaries: Sequence["RankSummary"], v: "Verdict", baselines: Mapping[Any, float],
               slower: Callable[[float, float | None], bool]) -> "Verdict":
    pairs = [(s.compute_s, baselines.get(("compute", s.rank))) for s in summaries]
    if not all(slower(c, b) for c, b in pairs):
        return dataclasses.replace(
            v, subject=f"every rank of replica group {group}",
            action=f"replica group {group}'s ranks wait longer on collectives while computing as before: on the "
                   "all-reduce across replica groups, for a slower replica group (its own report names it) or over "
                   "this group's link to the others; else the network or a shared storage/data source")
    return dataclasses.replace(
        v, kind="replica_group", subject=f"replica group {group}", group="compute",
        seconds=statistics.median(c for c, _ in pairs), reference_s=statistics.median(b for _, b in pairs),
        ratio=statistics.median(c / b for c, b in pairs if b), reference="baseline",
        action=_remove(group, "computes more than it did"), nodes=tuple(sorted({s.node for s in summaries})))


def _several_groups(members: dict[str, list[int]], summaries: Sequence["RankSummary"],
                    verdicts: list["Verdict"]) -> list["Verdict"]:
    node_of = {s.rank: s.node for s in summaries}
    out = list(verdicts)
    for group, ranks in sorted(members.items()):
        by_figure: dict[str, list[Verdict]] = {}
        for v in out:
            if v.kind in ("rank", "node", "link") and v.ranks and set(v.ranks) <= set(ranks):
                by_figure.setdefault("compute" if v.group == "compute" else "transfer", []).append(v)
        for figure, found in sorted(by_figure.items()):
            if {r for v in found for r in v.ranks} != set(ranks):
                continue
            what = ("computes slowly" if figure == "compute" else
                    "transfers slowly (" + ", ".join(sorted({v.group for v in found})) + ")")
            merged = dataclasses.replace(
                found[0], kind="replica_group", subject=f"replica group {group}",
                seconds=statistics.median(v.seconds for v in found),
                reference_s=statistics.median(v.reference_s for v in found),
                ratio=statistics.median(v.ratio for v in found), action=_remove(group, what),
                ranks=tuple(sorted(ranks)), nodes=tuple(sorted({node_of[r] for r in ranks})))
            first = out.index(found[0])
            out = [v for v in out if all(v is not f for f in found)]
            out.insert(min(first, len(out)), merged)
    return out
