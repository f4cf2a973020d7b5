"""NVLink islands of one node: the GPU sets an ``nvlink`` shard group may span.

[Note: NVLink islands]
NCCL runs its collectives as rings (and trees built on them) through the GPUs of a communicator; a
ring stays on NVLink only if every hop of it is an NVLink. So an island is a set of GPUs with an
NVLink ring through all of them: every pair joined (NVSwitch boards, bridged pairs), or a connected
graph with a Hamiltonian cycle such as DGX-1's hybrid cube-mesh, where GPU 0 reaches 1-4 directly
and 5-7 only through a neighbour, yet 0-1-5-4-7-6-2-3-0 is all NVLink. A component of the NVLink
graph with no such ring (a chain 0-1-2) is split greedily into the largest sets that have one; GPUs
with no NVLink are islands of one. The same test is applied to every planned ``nvlink`` shard group
(see :func:`has_ring`), so no group silently holds a PCIe hop.

Only components of up to :data:`MAX_RING_SEARCH` GPUs are searched for a ring; a larger component
counts as an island when every pair is joined (NVSwitch). A component without a ring is split only
up to :data:`MAX_SPLIT_SEARCH` GPUs (the search tries its subsets); a larger one becomes single GPUs.
Either way the note says so.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Mapping, Sequence

from hybridshard.topology.records import NodeProbe

__all__ = ["MAX_RING_SEARCH", "NvlinkIslands", "find_islands", "has_ring", "nvlink_graph"]

MAX_RING_SEARCH = 12
MAX_SPLIT_SEARCH = 8

Graph = Mapping[int, Mapping[int, int]]


@dataclass(frozen=True)
class NvlinkIslands:
    islands: tuple[tuple[int, ...], ...]
    """GPU indices of each island, sorted, islands ordered by their smallest GPU."""
    notes: tuple[str, ...] = ()
    """Irregularities: a GPU with no NVLink, uneven link counts inside an island, a component without a ring."""

    def island_of(self, gpu_index: int) -> tuple[int, ...]:
        return next(i for i in self.islands if gpu_index in i)


def nvlink_graph(probe: NodeProbe) -> dict[int, dict[int, int]]:
    """``{gpu: {peer: NVLinks}}`` from the ``NV#`` codes of the matrix and the GPUs' direct links."""
    graph: dict[int, dict[int, int]] = {g.index: {} for g in probe.gpus}
    for i, row in enumerate(probe.gpu_matrix[: len(probe.gpus)]):
        for j, code in enumerate(row[: len(probe.gpus)]):
            if i != j and code.startswith("NV") and code[2:].isdigit():
                graph[probe.gpus[i].index][probe.gpus[j].index] = int(code[2:])
    for g in probe.gpus:
        for peer in g.nvlink_peers:
            if peer in graph and peer != g.index:
                count = sum(1 for l in g.nvlinks if l.active and l.peer_index == peer)
                graph[g.index][peer] = max(graph[g.index].get(peer, 0), count)
                graph[peer][g.index] = max(graph[peer].get(g.index, 0), count)
    return graph


def has_ring(gpus: Sequence[int], graph: Graph) -> bool:
    """True when an NVLink ring runs through every GPU of ``gpus`` (one GPU, or a joined pair, count)."""
    members = sorted(set(gpus))
    if len(members) <= 1:
        return True
    if all(b in graph.get(a, {}) for a, b in itertools.combinations(members, 2)):
        return True
    if len(members) == 2 or len(members) > MAX_RING_SEARCH:
        return False
    # Held-Karp reachability: ends[mask] = GPUs a path from members[0] through exactly ``mask`` can end at.
    pos = {g: k for k, g in enumerate(members)}
    adj = [sum(1 << pos[p] for p in graph.get(g, {}) if p in pos) for g in members]
    full = (1 << len(members)) - 1
    ends = [0] * (full + 1)
    ends[1] = 1
    for mask in range(1, full + 1, 2):  # every path starts at members[0], so bit 0 is set
        reach = ends[mask]
        if not reach:
            continue
        for last in range(len(members)):
            if reach >> last & 1:
                for nxt in range(1, len(members)):
                    if adj[last] >> nxt & 1 and not mask >> nxt & 1:
                        ends[mask | 1 << nxt] |= 1 << nxt
    return any(ends[full] >> last & 1 and adj[last] & 1 for last in range(1, len(members)))


def _components(graph: Graph) -> list[list[int]]:
    seen: set[int] = set()
    out = []
    for start in sorted(graph):
        if start in seen:
            continue
        stack, comp = [start], []
        seen.add(start)
        while stack:
            g = stack.pop()
            comp.append(g)
            for p in graph[g]:
                if p not in seen:
                    seen.add(p)
                    stack.append(p)
        out.append(sorted(comp))
    return out


def _may_ring(members: Sequence[int], graph: Graph) -> bool:
    """Cheap necessary condition: three or more GPUs need two NVLink neighbours each among them."""
    return len(members) < 3 or all(sum(1 for p in graph[g] if p in members) >= 2 for g in members)


def _split(comp: list[int], graph: Graph) -> list[tuple[int, ...]]:
    if len(comp) > MAX_SPLIT_SEARCH:
        return [(g,) for g in comp]
    left, out = list(comp), []
    while left:
        for size in range(len(left), 0, -1):
            found = next(
                (s for s in itertools.combinations(left, size) if _may_ring(s, graph) and has_ring(s, graph)), None
            )
            if found is not None:
                out.append(tuple(found))
                left = [g for g in left if g not in found]
                break
    return out


def find_islands(probe: NodeProbe) -> NvlinkIslands:
    """The node's NVLink islands and what is irregular about them; see [Note: NVLink islands]."""
    graph = nvlink_graph(probe)
    islands: list[tuple[int, ...]] = []
    notes: list[str] = []
    for comp in _components(graph):
        if has_ring(comp, graph):
            islands.append(tuple(comp))
            continue
        parts = _split(comp, graph)
        islands += parts
        notes.append(
            f"GPUs {','.join(map(str, comp))} are joined by NVLink but no NVLink ring runs through all of them, "
            f"so NCCL would cross PCIe; they form the islands {' '.join('{' + ','.join(map(str, p)) + '}' for p in parts)}"
        )
    linked = [g for g in graph if graph[g]]
    if linked:
        alone = [g for g in graph if not graph[g]]
        for g in alone:
            notes.append(f"GPU {g} has no NVLink to any other GPU while GPUs {','.join(map(str, linked))} do: "
                         "check its NVLinks (nvidia-smi nvlink -s) or leave it out of NVLink shard groups")
    for island in islands:
        totals = {g: sum(graph[g].get(p, 0) for p in island) for g in island}
        if len(island) > 1 and len(set(totals.values())) > 1:
            most = max(totals.values())
            weak = [f"GPU {g} has {t}" for g, t in totals.items() if t < most]
            notes.append(f"uneven NVLink island {{{','.join(map(str, island))}}}: {'; '.join(weak)} NVLinks to it, "
                         f"the others {most}; the weakest GPU sets the pace of its rings")
    islands.sort(key=min)
    return NvlinkIslands(islands=tuple(islands), notes=tuple(notes))
