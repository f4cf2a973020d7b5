"""Racks in the estimates: the bytes a step's replicate reductions send through each network level,
and the time of a flat ring against two hops (``hybridshard plan --racks``; docs/planning.md,
"Racks"). The formulas and the cost model are :mod:`hybridshard.link_cost`'s; this module applies
them to one sizing option.

[Note: one replicate group's share]
A hybrid option with shard size ``S`` runs ``S`` replicate groups at once, one per GPU position,
each with one member per node. Every GPU has its own network link (``--inter-node-gbps``), and the
``S`` groups share each rack's uplink, so one group's model gets ``1 / S`` of it: ``nodes per rack *
--inter-node-gbps / oversubscription`` when the shard group fills the node. Bytes are summed over
the ``S`` groups (what the links' counters read in one step); times are the slowest group's. The
units' gradient shards are ``ceil(unit / S)`` elements: every full unit, a last partial one and the
root unit. Only options whose shard group fills a node are modelled (one member per node).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from hybridshard.estimates.sizing import DTYPE_BYTES, ClusterSpec, Estimate, ModelSpec
from hybridshard.link_cost import LinkRates, choose_rack_reduce, link_loads, network_order, predict_time

__all__ = ["FORM_LABELS", "RackEstimate", "RackLayout", "rack_dict", "rack_estimate", "render_racks", "unit_numels"]

FORM_LABELS = {"flat_launch": "flat, launch order", "flat_network": "flat, network order", "two_hop": "two hops"}


@dataclass(frozen=True)
class RackLayout:
    """Where the cluster's nodes sit, and the racks' uplinks."""

    node_racks: tuple[int, ...]
    """The rack (an index into :attr:`rack_names`) of each node, in the cluster's node order."""
    rack_names: tuple[str, ...]
    launch_orders: tuple[tuple[int, ...], ...]
    """For a shard group that fills the node: the rack of each member of each replicate group, the
    members in global-rank order (the order a launch hands out, before the planner's network order)."""
    source: str
    """Where the racks come from (``"--racks 4, nodes in blocks"``, ``"network_path of the nodes"``)."""
    oversubscription: float = 1.0
    spine_gbps: float | None = None
    """A rack's whole uplink, Gb/s per direction; ``None``: hosts x GPUs x inter-node rate / oversubscription."""

    def __post_init__(self) -> None:
        if not self.node_racks or not all(0 <= r < len(self.rack_names) for r in self.node_racks):
            raise ValueError(f"node_racks must index rack_names ({len(self.rack_names)}), found {self.node_racks[:8]}; "
                             "give each node its rack")
        if not (self.oversubscription > 0 and math.isfinite(self.oversubscription)):
            raise ValueError(f"--spine-oversubscription must be a positive ratio (7 for 1:7), "
                             f"found {self.oversubscription}")
        if self.spine_gbps is not None and not (self.spine_gbps > 0 and math.isfinite(self.spine_gbps)):
            raise ValueError(f"--spine-gbps must be a positive number of gigabits per second, found {self.spine_gbps}")

    @property
    def rack_sizes(self) -> tuple[int, ...]:
        return tuple(self.node_racks.count(r) for r in range(len(self.rack_names)))


@dataclass(frozen=True)
class RackEstimate:
    """One option's replicate reductions over the racks, per training step."""

    racks: int
    per_rack: int
    groups: int
    """Replicate groups at once (the shard size)."""
    kinds: tuple[str, ...]
    """``("all_reduce",)``, or ``("reduce_scatter", "all_gather")`` with the optimizer sharded across replicas."""
    level_bytes: dict[str, dict[str, float]] = field(default_factory=dict)
    """By form (:data:`FORM_LABELS`): ``link_cost.level_bytes``'s keys, summed over the groups."""
    seconds: dict[str, float] = field(default_factory=dict)
    """By form: the predicted communication time of the slowest group."""
    picks: tuple[tuple[str, bool, str], ...] = ()
    """``(kind, two hops?, reason)``: what ``choose_rack_reduce`` (``rack_reduce=None``) answers."""
    skipped: str | None = None
    """Why the option is not modelled, when it is not."""


def unit_numels(model: ModelSpec) -> list[int]:
    """Elements of each unit: full units, a last partial one, and the root unit."""
    full, rest = divmod(model.num_params - model.root_params, model.unit_params)
    return [model.unit_params] * full + [n for n in (rest, model.root_params) if n]


def _rates(e: Estimate, cluster: ClusterSpec, layout: RackLayout, per_rack: int) -> LinkRates:
    """See [Note: one replicate group's share]."""
    spine = None if layout.spine_gbps is None else layout.spine_gbps / e.shard_size
    return LinkRates.from_gbps(node_gbps=cluster.inter_node_gbps, rack_hosts=per_rack,
                               oversubscription=layout.oversubscription, spine_gbps=spine)


def _sum(per_group: list[list[Any]]) -> dict[str, float]:
    """``level_bytes``'s dict over every group's links together; ``per_group[g]``: group ``g``'s loads of each kind."""
    spine = [sum(col) for col in zip(*(loads.spine for kinds in per_group for loads in kinds))]
    node = [sum(col) for kinds in per_group for col in zip(*(loads.node for loads in kinds))]
    return {"node": sum(node), "node_max": max(node), "spine": sum(spine), "spine_max": max(spine)}


def rack_estimate(e: Estimate, *, model: ModelSpec, cluster: ClusterSpec, layout: RackLayout) -> RackEstimate | None:
    """The replicate reductions of ``e`` over ``layout``'s racks; ``None`` when ``e`` has none."""
    if not e.strategy.is_hybrid or e.replicate_size == 1:
        return None
    sizes = layout.rack_sizes
    racks, per_rack = len(sizes), sizes[0]
    kinds = ("reduce_scatter", "all_gather") if e.shard_optimizer else ("all_reduce",)
    out = dict(racks=racks, per_rack=per_rack, groups=e.shard_size, kinds=kinds)
    if len(set(cluster.node_sizes)) != 1 or e.shard_size != cluster.node_sizes[0]:
        return RackEstimate(**out, skipped=f"shard size {e.shard_size} puts several members of a replicate group on "
                                           "one node; the rack model takes one per node (a shard group filling it)")
    if len(set(sizes)) != 1:
        return RackEstimate(**out, skipped=f"racks hold {sorted(set(sizes))} nodes; two hops need racks of equal size")
    dtype = {"all_reduce": model.reduce_dtype, "reduce_scatter": model.reduce_dtype, "all_gather": model.param_dtype}
    units = {k: [-(-n // e.shard_size) * DTYPE_BYTES[dtype[k]] for n in unit_numels(model)] for k in kinds}
    rates = _rates(e, cluster, layout, per_rack)
    forms = {"flat_launch": ("flat", None), "flat_network": ("flat", "network"), "two_hop": ("two_hop", None)}
    level_bytes, seconds = {}, {}
    for label, (form, how) in forms.items():
        orders = [network_order(o) if how else list(o) for o in layout.launch_orders]
        loads = [[link_loads(form, racks=racks, per_rack=per_rack, nbytes=sum(units[k]), kind=k, order=o)
                  for k in kinds] for o in orders]
        level_bytes[label] = _sum(loads)
        seconds[label] = max(sum(predict_time(form, racks=racks, per_rack=per_rack, unit_bytes=units[k], rates=rates,
                                              kind=k, order=o) for k in kinds) for o in orders)
    picks = tuple((k, *choose_rack_reduce(racks=racks, per_rack=per_rack, unit_bytes=units[k], rates=rates, kind=k))
                  for k in kinds)
    return RackEstimate(**out, level_bytes=level_bytes, seconds=seconds, picks=picks)


def rack_dict(r: RackEstimate | None) -> dict[str, Any] | None:
    if r is None:
        return None
    return {"racks": r.racks, "per_rack": r.per_rack, "replicate_groups": r.groups, "kinds": list(r.kinds),
            "level_bytes": r.level_bytes, "seconds": r.seconds, "skipped": r.skipped,
            "rack_reduce_none_picks": [{"kind": k, "two_hop": two, "reason": why} for k, two, why in r.picks]}


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f}"


def render_racks(layout: RackLayout, r: RackEstimate | None, *, label: str, cluster: ClusterSpec) -> list[str]:
    """Text lines for the recommended option ``label``."""
    sizes = layout.rack_sizes
    shape = f"{len(sizes)} racks x {sizes[0]} nodes" if len(set(sizes)) == 1 else f"racks of {list(sizes)} nodes"
    uplink = layout.spine_gbps if layout.spine_gbps is not None else (
        sizes[0] * cluster.node_sizes[0] * cluster.inter_node_gbps / layout.oversubscription)
    lines = ["", f"racks: {shape} ({layout.source}); a rack's uplink {uplink:g} Gb/s per direction "
                 f"(1:{layout.oversubscription:g})"]
    if r is None:
        return lines + [f"  {label}: no replicate reduction"]
    if r.skipped:
        return lines + [f"  {label}: not modelled: {r.skipped}"]
    lines.append(f"replicate reduction of {label}, per step, {r.groups} replicate groups at once "
                 "(bandwidth terms only, units pipelined):")
    head = ("form", "GB each GPU link", "GB each rack uplink", "GB all uplinks", "comm s")
    rows = [head] + [(FORM_LABELS[f], _gb(b["node_max"]), _gb(b["spine_max"]), _gb(b["spine"]), f"{r.seconds[f]:.3f}")
                     for f, b in r.level_bytes.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines += ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines += [f"  rack_reduce=None picks {'two hops' if two else 'flat'} for the {k.replace('_', '-')}: {why}"
              for k, two, why in r.picks]
    return lines
