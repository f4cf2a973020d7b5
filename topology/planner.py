"""Plan shard and replicate groups from a cluster view: a pure function, no process group.

[Note: the hybrid grid]
Ranks are split into *fast domains* (a node, an NVLink island or fabric clique, a NUMA node). Each
domain is cut into shard groups of ``shard_size`` ranks; every shard group lies inside one domain, so
the heavy all-gathers and reduce-scatters stay on fast links. Replicate group ``i`` holds the ``i``-th
member of every shard group, so the gradient all-reduce of shard ``i`` crosses domains once per rank.
The plan is an ``R x S`` grid: ``mesh()[r][s]`` is the ``s``-th member of shard group ``r``, row ``r``
is a shard group and column ``s`` a replicate group.

[Note: canonical order]
Domains are ordered by their lowest global rank, ranks inside a domain by node order and then local
rank. Every rank computes the same plan from the same view, whatever order the launcher handed out
global ranks in (torchrun's blocks, SLURM ``cyclic``, a custom launcher), and group position ``s`` is
the same local position on every node, so replicate groups pair like with like.

[Note: network order]
Above the node the costliest links are the racks' uplinks to the spine. Domains are therefore put in
*network order* before they are cut: by the network path of their first host (``pod/rack``, see
:mod:`hybridshard.topology.netpath`), then by their lowest global rank. Shard groups follow that
order, and so do the members of every replicate group: a ring over a replicate group enters and
leaves each rack once, whatever order the launcher handed out global ranks in (a cyclic launch that
interleaves racks would otherwise cross the spine at every hop). Without network paths every path
is empty and the order is the canonical one above. :func:`build_groups` keeps this order as the
group rank (``new_group(..., sort_ranks=False)``), and ``row_racks`` records each shard group's rack
so that a replicate reduction can run in two hops (inside each rack, then across racks).

A ``shard_size`` above the node size makes shard groups of whole nodes (``domain="node"``): see
[Note: shard groups over nodes] in :mod:`hybridshard.topology.multinode`.

[Note: choosing the shard size]
Without ``shard_size`` the plan takes the largest size that tiles every domain (the gcd of the
domain sizes): 8 on uniform 8-GPU nodes, 4 for a mix of 8- and 4-GPU nodes. When only 1 would tile
(e.g. nodes of 3 and 2 ranks) the plan refuses rather than silently dropping to pure replication;
``shard_size=1`` asked for explicitly is honoured, and still replicates across every rank.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Mapping

from hybridshard.topology.islands import find_islands, has_ring, nvlink_graph
from hybridshard.topology.multinode import tile_nodes
from hybridshard.topology.records import ClusterNode, ClusterView, RankEntry

__all__ = ["DOMAINS", "Domain", "GroupPlan", "find_domains", "format_plan", "plan_groups"]

DOMAINS = ("node", "nvlink", "numa")


@dataclass(frozen=True)
class Domain:
    """A set of ranks joined by fast links, in canonical order."""

    key: str
    ranks: tuple[int, ...]
    hosts: tuple[str, ...]


@dataclass(frozen=True)
class GroupPlan:
    """Who shards with whom and who replicates with whom; see [Note: the hybrid grid]."""

    world_size: int
    shard_size: int
    replicate_size: int
    domain: str
    shard_groups: tuple[tuple[int, ...], ...]
    replicate_groups: tuple[tuple[int, ...], ...]
    shard_group_domains: tuple[str, ...]
    """The domain key of each shard group (``"node0"``, ``"node0/nvlink1"``, ``"fabric:<uuid>/<clique>"``)."""
    notes: tuple[str, ...] = ()
    row_racks: tuple[str, ...] = ()
    """The rack (network path, ``"pod0/rack1"``; ``""`` when unknown) of each shard group, in plan
    order; empty for plans made without a cluster's network paths. See [Note: network order]."""
    shard_nodes: int = 1
    """``k``: the nodes each shard group spans; above 1 only when ``shard_size`` exceeds the node size
    (see [Note: shard groups over nodes] in :mod:`hybridshard.topology.multinode`)."""
    shard_group_hosts: tuple[tuple[str, ...], ...] = ()
    """With ``shard_nodes > 1``: each shard group's nodes in member order (node ``j`` holds shard ranks
    ``j * g`` to ``j * g + g - 1``, ``g = shard_size // shard_nodes``); empty otherwise."""

    @property
    def ranks_per_node(self) -> int:
        """``g``: members of a shard group on each of its nodes (the shard size when ``shard_nodes`` is 1)."""
        return self.shard_size // self.shard_nodes

    @functools.cached_property
    def _coords(self) -> dict[int, tuple[int, int]]:
        return {rank: (r, s) for r, group in enumerate(self.shard_groups) for s, rank in enumerate(group)}

    def coords(self, rank: int) -> tuple[int, int]:
        """``(replicate_index, shard_index)``: the row (shard group) and column (replicate group) of ``rank``."""
        try:
            return self._coords[rank]
        except KeyError:
            raise ValueError(f"rank {rank} is not in this plan (world size {self.world_size})") from None

    def shard_group_of(self, rank: int) -> tuple[int, ...]:
        return self.shard_groups[self.coords(rank)[0]]

    def replicate_group_of(self, rank: int) -> tuple[int, ...]:
        return self.replicate_groups[self.coords(rank)[1]]

    def mesh(self) -> list[list[int]]:
        """The ``R x S`` rank grid: rows are shard groups, columns replicate groups."""
        return [list(g) for g in self.shard_groups]

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": self.world_size,
            "shard_size": self.shard_size,
            "replicate_size": self.replicate_size,
            "domain": self.domain,
            "shard_groups": [list(g) for g in self.shard_groups],
            "replicate_groups": [list(g) for g in self.replicate_groups],
            "shard_group_domains": list(self.shard_group_domains),
            "notes": list(self.notes),
            "row_racks": list(self.row_racks),
            "shard_nodes": self.shard_nodes,
            "shard_group_hosts": [list(h) for h in self.shard_group_hosts],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "GroupPlan":
        return cls(
            world_size=int(d["world_size"]),
            shard_size=int(d["shard_size"]),
            replicate_size=int(d["replicate_size"]),
            domain=d["domain"],
            shard_groups=tuple(tuple(g) for g in d["shard_groups"]),
            replicate_groups=tuple(tuple(g) for g in d["replicate_groups"]),
            shard_group_domains=tuple(d["shard_group_domains"]),
            notes=tuple(d.get("notes", ())),
            row_racks=tuple(d.get("row_racks", ())),
            shard_nodes=int(d.get("shard_nodes", 1)),
            shard_group_hosts=tuple(tuple(h) for h in d.get("shard_group_hosts", ())),
        )

    def rack_rows(self) -> tuple[tuple[int, ...], ...]:
        """The shard groups (rows) of each rack, racks in plan order; one rack when none is known."""
        racks: dict[str, list[int]] = {}
        for row, rack in enumerate(self.row_racks or ("",) * len(self.shard_groups)):
            racks.setdefault(rack, []).append(row)
        return tuple(tuple(rows) for rows in racks.values())


def _node_domains(cluster: ClusterView) -> list[Domain]:
    return [Domain(n.name, n.global_ranks, (n.name,)) for n in cluster.nodes]


def _gpu_of(node: ClusterNode, entry: RankEntry, domain: str):
    gpu = node.probe.gpu_by_uuid(entry.gpu_uuid) if entry.gpu_uuid else None
    if gpu is None:
        raise ValueError(
            f"domain={domain!r} needs the GPU of every rank; rank {entry.rank} on host {node.name!r} "
            f"has {'no GPU' if not entry.gpu_uuid else f'GPU {entry.gpu_uuid} not found in the node probe'}. "
            "Use domain='node' on machines without GPUs."
        )
    return gpu


def _nvlink_islands(node: ClusterNode) -> dict[int, int]:
    """Map each GPU index of ``node`` to the smallest GPU index of its NVLink island (see
    [Note: NVLink islands] in :mod:`hybridshard.topology.islands`)."""
    return {g: min(island) for island in find_islands(node.probe).islands for g in island}


def _nvlink_domains(cluster: ClusterView) -> list[Domain]:
    # [Note: fabric cliques] GPUs of a multi-node NVLink rack report the fabric's cluster UUID and a
    # clique id; GPUs of one clique talk over NVLink across hosts, so the clique is the domain.
    members: dict[str, list[tuple[int, int, int]]] = {}
    hosts: dict[str, list[str]] = {}
    for node_pos, node in enumerate(cluster.nodes):
        islands = None
        for e in node.ranks:
            gpu = _gpu_of(node, e, "nvlink")
            if gpu.fabric_cluster_uuid and gpu.fabric_clique_id is not None:
                key = f"fabric:{gpu.fabric_cluster_uuid}/{gpu.fabric_clique_id}"
            else:
                islands = islands if islands is not None else _nvlink_islands(node)
                key = f"{node.name}/nvlink{islands[gpu.index]}"
            members.setdefault(key, []).append((node_pos, e.local_rank, e.rank))
            if node.name not in hosts.setdefault(key, []):
                hosts[key].append(node.name)
    return [Domain(k, tuple(r for _, _, r in sorted(v)), tuple(hosts[k])) for k, v in members.items()]


def _numa_domains(cluster: ClusterView) -> list[Domain]:
    out: list[Domain] = []
    for node in cluster.nodes:
        by_numa: dict[int, list[int]] = {}
        for e in node.ranks:
            if e.gpu_uuid:
                numa = _gpu_of(node, e, "numa").numa_node
            else:
                affinity = set(e.cpu_affinity)
                numa = next((n.id for n in node.probe.numa_nodes if affinity and affinity <= set(n.cpus)), None)
            if numa is None:
                raise ValueError(
                    f"domain='numa' needs each rank's NUMA node; rank {e.rank} on host {node.name!r} has "
                    "neither a GPU with a known NUMA node nor a CPU affinity inside one NUMA node. "
                    "Launch with `hybridshard launch --bind-numa` or use domain='node'."
                )
            by_numa.setdefault(numa, []).append(e.rank)
        out += [Domain(f"{node.name}/numa{k}", tuple(v), (node.name,)) for k, v in sorted(by_numa.items())]
    return out


def find_domains(cluster: ClusterView, domain: str = "node") -> list[Domain]:
    """The fast domains of ``cluster``, ordered by their lowest global rank."""
    finders = {"node": _node_domains, "nvlink": _nvlink_domains, "numa": _numa_domains}
    if domain not in finders:
        raise ValueError(f"domain must be one of {DOMAINS}, got {domain!r}")
    domains = finders[domain](cluster)
    paths = {n.name: n.network_path for n in cluster.nodes}
    # See [Note: network order]: racks first, then the canonical order inside each.
    domains.sort(key=lambda d: (paths.get(d.hosts[0], ()), min(d.ranks)))
    return domains


def _rack_of(cluster: ClusterView, d: Domain) -> str:
    paths = {n.name: n.network_path for n in cluster.nodes}
    return "/".join(paths.get(d.hosts[0], ()))


def _describe(domains: list[Domain], limit: int = 8) -> str:
    text = ", ".join(f"{d.key}: {len(d.ranks)}" for d in domains[:limit])
    return text + (f", ... ({len(domains)} domains)" if len(domains) > limit else "")


def _choose_shard_size(domains: list[Domain], shard_size: int | None, domain: str) -> tuple[int, list[str]]:
    sizes = [len(d.ranks) for d in domains]
    common = functools.reduce(math.gcd, sizes)
    divisors = [k for k in range(1, common + 1) if common % k == 0]
    if shard_size is not None:
        if isinstance(shard_size, bool) or not isinstance(shard_size, int) or shard_size < 1:
            raise ValueError(f"shard_size must be a positive integer, got {shard_size!r}")
        bad = [d for d in domains if len(d.ranks) % shard_size]
        if bad:
            raise ValueError(
                f"shard_size={shard_size} does not tile every {domain} domain: ranks per domain are "
                f"{_describe(bad)}; each shard group must lie inside one domain. "
                f"Use one of {divisors} or leave shard_size unset."
            )
        return shard_size, []
    if common == 1 and max(sizes) > 1:
        raise ValueError(
            f"no shard size above 1 tiles every {domain} domain (ranks per domain: {_describe(domains)}). "
            "Run the same number of ranks per domain, or pass shard_size=1 to replicate without sharding."
        )
    notes = []
    if common < max(sizes):
        largest = max(domains, key=lambda d: len(d.ranks))
        notes.append(
            f"shard size {common} is below the largest domain ({largest.key}: {len(largest.ranks)} ranks) "
            "because domains differ in size"
        )
    return common, notes


def plan_groups(cluster: ClusterView, *, shard_size: int | None = None, domain: str = "node") -> GroupPlan:
    """Plan shard groups (inside fast domains, or over whole nodes when ``shard_size`` exceeds the
    node size) and replicate groups (across them); pure."""
    domains = find_domains(cluster, domain)
    if domain == "node" and _over_nodes(domains, shard_size):
        return _node_groups_plan(cluster, domains, shard_size)
    size, notes = _choose_shard_size(domains, shard_size, domain)
    shard_groups: list[tuple[int, ...]] = []
    labels: list[str] = []
    racks: list[str] = []
    for d in domains:
        pieces = len(d.ranks) // size
        for k in range(pieces):
            shard_groups.append(d.ranks[k * size : (k + 1) * size])
            labels.append(d.key if pieces == 1 else f"{d.key}#{k}")
            racks.append(_rack_of(cluster, d))
    if domain == "nvlink":
        _check_rings(cluster, shard_groups, domains, size)
    replicate_groups = tuple(zip(*shard_groups))
    if size == 1:
        notes.append("shard size 1: no sharding; gradients are still all-reduced across every rank")
    return GroupPlan(
        world_size=cluster.world_size,
        shard_size=size,
        replicate_size=len(shard_groups),
        domain=domain,
        shard_groups=tuple(shard_groups),
        replicate_groups=replicate_groups,
        shard_group_domains=tuple(labels),
        notes=tuple(notes),
        row_racks=tuple(racks) if any(racks) else (),
    )


def _over_nodes(domains: list[Domain], shard_size: int | None) -> bool:
    """A valid ``shard_size`` above every node's rank count: shard groups of whole nodes."""
    valid = isinstance(shard_size, int) and not isinstance(shard_size, bool)
    return valid and shard_size > max(len(d.ranks) for d in domains)


def _node_groups_plan(cluster: ClusterView, domains: list[Domain], shard_size: int) -> GroupPlan:
    """See [Note: shard groups over nodes] in :mod:`hybridshard.topology.multinode`."""
    tiling = tile_nodes(domains, shard_size, {n.name: "/".join(n.network_path) for n in cluster.nodes})
    return GroupPlan(
        world_size=cluster.world_size,
        shard_size=shard_size,
        replicate_size=len(tiling.groups),
        domain="node",
        shard_groups=tiling.groups,
        replicate_groups=tuple(zip(*tiling.groups)),
        shard_group_domains=tiling.labels,
        row_racks=tiling.racks if any(tiling.racks) else (),
        shard_nodes=tiling.nodes_per_group,
        shard_group_hosts=tiling.hosts,
    )


def _ringless(cluster: ClusterView, groups: list[tuple[int, ...]]) -> list[str]:
    """Shard groups inside one node whose GPUs have no NVLink ring, described."""
    out = []
    for group in groups:
        nodes = {cluster.node_of(r).name for r in group}
        if len(nodes) != 1:
            continue  # a fabric clique: NVLink through switches between every pair
        node = cluster.node_of(group[0])
        by_rank = {e.rank: e for e in node.ranks}
        gpus = [_gpu_of(node, by_rank[r], "nvlink").index for r in group]
        if not has_ring(gpus, nvlink_graph(node.probe)):
            out.append(f"ranks {list(group)} on {node.name!r} (GPUs {','.join(map(str, gpus))})")
    return out


def _check_rings(cluster: ClusterView, groups: list[tuple[int, ...]], domains: list[Domain], size: int) -> None:
    # See [Note: NVLink islands]: an island has a ring, but a slice of it may not.
    bad = _ringless(cluster, groups)
    if not bad:
        return
    common = functools.reduce(math.gcd, [len(d.ranks) for d in domains])
    good = [
        k for k in range(1, common + 1)
        if common % k == 0 and not _ringless(cluster, [d.ranks[i:i + k] for d in domains for i in range(0, len(d.ranks), k)])
    ]
    raise ValueError(
        f"shard size {size} puts a PCIe hop inside an NVLink shard group: no NVLink ring runs through "
        f"{'; '.join(bad[:4])}{' ...' if len(bad) > 4 else ''}. Use a shard size with rings ({good}) or domain='node'."
    )


def format_plan(plan: GroupPlan, *, max_rows: int = 16) -> str:
    """The plan as text: one line per shard group and per replicate group (long lists elided)."""

    def rows(title: str, groups: tuple[tuple[int, ...], ...], labels: tuple[str, ...] | None) -> list[str]:
        out = [f"{title} ({len(groups)} x {len(groups[0]) if groups else 0} ranks):"]
        for i, g in enumerate(groups[:max_rows]):
            members = ", ".join(map(str, g[:max_rows])) + (", ..." if len(g) > max_rows else "")
            rack = f" @ {plan.row_racks[i]}" if labels and plan.row_racks else ""
            where = f"  [{labels[i]}{rack}]" if labels else ""
            out.append(f"  {i:>4}: {members}{where}")
        if len(groups) > max_rows:
            out.append(f"  ... {len(groups) - max_rows} more")
        return out

    lines = [
        f"plan: world size {plan.world_size} = {plan.replicate_size} replica{'s' if plan.replicate_size != 1 else ''}"
        f" x shard size {plan.shard_size} "
        f"(domain: {plan.domain}"
        + (f", {plan.shard_nodes} nodes x {plan.ranks_per_node} ranks per shard group)" if plan.shard_nodes > 1 else ")")
    ]
    lines += rows("shard groups", plan.shard_groups, plan.shard_group_domains)
    lines += rows("replicate groups", plan.replicate_groups, None)
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
