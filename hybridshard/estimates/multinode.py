"""Sizing shard groups over ``k`` whole nodes: peak memory per GPU and bytes per step across nodes and
racks for k = 1, 2, 4 ..., and the smallest ``k`` that fits (``hybridshard plan --multi-node``;
docs/planning.md, "Shard groups over nodes"). Pure math, as :mod:`hybridshard.estimates.sizing`.

[Note: bytes out of a node]
Every setting is ``HYBRID_SHARD`` with shard size ``S = k * g`` (``k`` nodes of ``g`` GPUs) and ``R =
nodes / k`` replicas. Bytes are what one node sends to other nodes in one step (``k = 1``: nothing of
the shard group). A unit of ``M`` bytes gathered or reduced in two hops (across nodes among the ranks
of one position, then inside the node) sends ``M (k - 1) / k`` out of every node; a flat ring over
the ``S`` ranks, node by node, ``M (S - 1) / S`` (each ring leaves a node once). Per step ZeRO-3
gathers every unit twice (the root once) and reduce-scatters every gradient once; with the node-local
secondary shard (``reshard_after_forward="node"``) the backward's gather stays inside the node. The
replicate reduction of a ``M / S`` gradient shard leaves the node from every one of its ``g`` ranks,
since each replicate group has one member per shard group. Across racks: shard groups lie inside a
rack, so only replicate rings cross the spine, each entering and leaving a rack once (network order).

[Note: the secondary shard's memory]
With the secondary shard every ZeRO-3 unit keeps ``1 / g`` of itself in the compute dtype from its
forward to its backward (instead of nothing beyond the master's ``1 / S``), so at the units' peak (the
first unit's backward) all of them are alive: ``sum(ceil(unit / g))`` elements. They are freed after
each unit's backward, so the root's backward (``MemoryEstimate.root_backward``) holds none.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from hybridshard.comm_bytes import ring_factor
from hybridshard.estimates.sizing import ClusterSpec, MemoryEstimate, ModelSpec, memory
from hybridshard.link_cost import block_order, level_bytes
from hybridshard.runtime.units.strategy import ShardingStrategy

__all__ = ["NodeRecommendation", "NodeSetting", "node_counts", "node_settings", "recommend_nodes", "render_nodes",
           "settings_dict"]


@dataclass(frozen=True)
class NodeSetting:
    """``HYBRID_SHARD`` with shard groups of ``nodes`` whole nodes."""

    nodes: int
    """``k``: nodes per shard group."""
    shard_size: int
    replicate_size: int
    shard_optimizer: bool
    """``shard_optimizer_across_replicas=True``."""
    secondary: bool
    """``reshard_after_forward="node"``: the node-local secondary shard; see [Note: the secondary shard's memory]."""
    memory: MemoryEstimate
    secondary_bytes: int
    hop_bytes: int
    """Without the secondary shard: the hop across nodes' result, ``ceil(U / g)`` per gather in flight
    (``prefetch + 1`` at the units' peak), alive until the hop inside the node is done."""
    node_bytes: float
    """Bytes each node sends to other nodes per step, shard group in two hops; see [Note: bytes out of a node]."""
    node_bytes_flat: float
    """The same with flat rings over the shard group."""
    rack_bytes: float | None
    """Bytes each rack's uplink carries per step (one direction); ``None`` when racks are unknown."""
    node_seconds: float
    """``node_bytes`` at the node's network rate (``g`` x the inter-node rate per GPU)."""

    @property
    def peak(self) -> int:
        """Bytes per GPU at the step's peak (activations not included)."""
        m = self.memory
        units = m.gathered + self.secondary_bytes + self.hop_bytes
        return m.params + m.grads + m.optimizer + max(units, m.root_backward, m.step_temp)

    @property
    def label(self) -> str:
        return f"k={self.nodes}" + (" +optim" if self.shard_optimizer else "") + (" +node" if self.secondary else "")


@dataclass(frozen=True)
class NodeRecommendation:
    choice: NodeSetting | None
    reason: str
    budget: int
    """Bytes a setting may peak at: the GPU's memory less the headroom."""


def node_counts(num_nodes: int, rack_sizes: Sequence[int] = ()) -> list[int]:
    """``k`` values that tile the job's nodes, and every rack's when racks are known."""
    return [k for k in range(1, num_nodes + 1) if num_nodes % k == 0 and all(n % k == 0 for n in rack_sizes)]


def _secondary_numel(model: ModelSpec, per_node: int) -> int:
    full, rest = divmod(model.num_params - model.root_params, model.unit_params)
    return full * -(-model.unit_params // per_node) + -(-rest // per_node)


def _rack_bytes(model: ModelSpec, s: int, r: int, rack_sizes: Sequence[int], k: int, optim: bool) -> float | None:
    """One rack uplink's bytes per step: the ``s`` replicate groups' flat rings in network order."""
    if not rack_sizes:
        return None
    racks, per_rack = len(rack_sizes), rack_sizes[0] // k
    if racks == 1 or r == 1:
        return 0.0
    shard = model.num_params / s
    kinds = [("reduce_scatter", model.b_reduce), ("all_gather", model.b_param)] if optim else [("all_reduce", model.b_reduce)]
    return s * sum(level_bytes("flat", racks=racks, per_rack=per_rack, nbytes=shard * b, kind=kind,
                               order=block_order(racks, per_rack))["spine_max"] for kind, b in kinds)


def _setting(model: ModelSpec, cluster: ClusterSpec, k: int, optim: bool, secondary: bool, rack_sizes: Sequence[int],
             prefetch: int) -> NodeSetting:
    g = cluster.node_sizes[0]
    s, r = k * g, cluster.num_nodes // k
    mem = memory(ShardingStrategy.HYBRID_SHARD, s, model=model, prefetch=prefetch, replicate_size=r,
                 shard_optimizer=optim)
    n, root = model.num_params, model.root_params
    units = (n - root) * model.b_param  # gathered in forward, and again in backward unless held on the node
    gathers_crossing = root * model.b_param + units * (1 if secondary else 2)
    reduced = n * model.b_reduce
    shard_two_hop = (gathers_crossing + reduced) * (k - 1) / k
    shard_flat = (gathers_crossing + reduced) * (s - 1) / s if k > 1 else 0.0
    if optim:
        replicate = g * (ring_factor("reduce_scatter", r) * n / s * model.b_reduce
                         + ring_factor("all_gather", r) * n / s * model.b_param)
    else:
        replicate = g * ring_factor("all_reduce", r) * n / s * model.b_reduce
    rate = g * cluster.inter_node_gbps * 1e9 / 8
    return NodeSetting(
        nodes=k, shard_size=s, replicate_size=r, shard_optimizer=optim, secondary=secondary, memory=mem,
        secondary_bytes=_secondary_numel(model, g) * model.b_param if secondary else 0,
        hop_bytes=(prefetch + 1) * -(-model.unit_params // g) * model.b_param if k > 1 and g > 1 and not secondary else 0,
        node_bytes=shard_two_hop + replicate, node_bytes_flat=shard_flat + replicate,
        rack_bytes=_rack_bytes(model, s, r, rack_sizes, k, optim), node_seconds=(shard_two_hop + replicate) / rate,
    )


def node_settings(*, model: ModelSpec, cluster: ClusterSpec, rack_sizes: Sequence[int] = (),
                  prefetch: int = 1) -> list[NodeSetting]:
    """Every ``k`` of :func:`node_counts`, each without and with the optimizer across replicas (when
    there are replicas) and the secondary shard (when a shard group spans nodes of several GPUs)."""
    if len(set(cluster.node_sizes)) != 1:
        raise ValueError(f"expected nodes of one size for shard groups over nodes, found {sorted(set(cluster.node_sizes))} "
                         "GPUs per node; size each kind of node on its own")
    if rack_sizes and sum(rack_sizes) != cluster.num_nodes:
        raise ValueError(f"expected rack sizes summing to the {cluster.num_nodes} nodes, found {list(rack_sizes)}; "
                         "give every node one rack")
    g = cluster.node_sizes[0]
    out = []
    for k in node_counts(cluster.num_nodes, rack_sizes):
        for optim in (False, True) if cluster.num_nodes // k > 1 else (False,):
            for secondary in (False, True) if k > 1 and g > 1 else (False,):
                out.append(_setting(model, cluster, k, optim, secondary, rack_sizes, prefetch))
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def recommend_nodes(settings: Sequence[NodeSetting], *, cluster: ClusterSpec, headroom: float = 0.10) -> NodeRecommendation:
    """The smallest ``k`` with a setting whose peak fits the GPU less ``headroom`` (a fraction kept for
    activations and the allocator); among that ``k``'s fitting settings the fewest bytes across nodes,
    then the least memory."""
    if not (0 <= headroom < 1 and math.isfinite(headroom)):
        raise ValueError(f"expected a headroom fraction in [0, 1) (0.1 for 10 %), found {headroom!r}; pass e.g. --headroom 0.1")
    budget = int(cluster.gpu_memory_bytes * (1 - headroom))
    fitting = [s for s in settings if s.peak <= budget]
    keep = f"{_gb(budget)} ({headroom:.0%} of {_gb(cluster.gpu_memory_bytes)} kept for activations)"
    if not fitting:
        smallest = min(settings, key=lambda s: s.peak)
        return NodeRecommendation(None, f"nothing fits in {keep}: the smallest, {smallest.label}, peaks at "
                                        f"{_gb(smallest.peak)}; add nodes, use GPUs with more memory, or lower --headroom", budget)
    k = min(s.nodes for s in fitting)
    best = min((s for s in fitting if s.nodes == k), key=lambda s: (s.node_bytes, s.peak))
    return NodeRecommendation(best, f"the smallest k that fits in {keep}: {best.label} peaks at {_gb(best.peak)} and "
                                    f"sends {_gb(best.node_bytes)} out of each node per step", budget)


def render_nodes(settings: Sequence[NodeSetting], rec: NodeRecommendation, *, cluster: ClusterSpec) -> list[str]:
    """The table of settings and the recommendation, as text lines."""
    g = cluster.node_sizes[0]
    lines = ["", f"shard groups over nodes ({cluster.num_nodes} nodes x {g} GPUs; HYBRID_SHARD, shard size k x {g}; "
                 "+optim: optimizer across replicas, +node: reshard_after_forward='node'):"]
    head = ("setting", "shard", "replicas", "peak GB/GPU", "fits", "GB out/node (2 hops)", "(flat)", "GB/rack uplink",
            "comm s")
    rows = [head] + [(s.label, str(s.shard_size), str(s.replicate_size), f"{s.peak / 1e9:.1f}",
                      "yes" if s.peak <= rec.budget else "no", f"{s.node_bytes / 1e9:.1f}", f"{s.node_bytes_flat / 1e9:.1f}",
                      "-" if s.rack_bytes is None else f"{s.rack_bytes / 1e9:.1f}", f"{s.node_seconds:.2f}")
                     for s in settings]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    chosen = rec.choice.label if rec.choice else "none"
    return lines + [f"recommended: {chosen}: {rec.reason}"]


def settings_dict(settings: Sequence[NodeSetting], rec: NodeRecommendation) -> dict[str, Any]:
    rows = [{"nodes_per_shard_group": s.nodes, "shard_size": s.shard_size, "replicate_size": s.replicate_size,
             "shard_optimizer": s.shard_optimizer, "secondary_shard": s.secondary, "peak_bytes": s.peak,
             "secondary_bytes": s.secondary_bytes, "node_bytes_two_hop": s.node_bytes, "node_bytes_flat": s.node_bytes_flat,
             "rack_uplink_bytes": s.rack_bytes, "node_seconds": s.node_seconds, "fits": s.peak <= rec.budget}
            for s in settings]
    choice = None if rec.choice is None else {"nodes_per_shard_group": rec.choice.nodes, "label": rec.choice.label}
    return {"settings": rows, "budget_bytes": rec.budget, "recommended": choice, "reason": rec.reason}
