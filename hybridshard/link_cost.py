"""Bytes per network level, and the time they take, for a replicate group spread over racks: one flat
ring against two hops (inside each rack, then across racks). Pure: no process group, no tensor.

A replicate group of ``R = P * r`` members sits in ``P`` racks, ``r`` members in each, one per host.
Hosts reach their rack's switch through their own link (the *node* level); a rack reaches the
spine through one uplink its hosts share (the *spine* level), and racks may be grouped in pods
whose uplinks form a *pod* level above. Every collective over ``M`` bytes (the full buffer, as in
:mod:`hybridshard.comm_bytes`) takes one of two forms:

- ``"flat"``: one ring over the ``R`` members in group-rank order. ``order[m]`` is the rack of
  member ``m``; every ring edge between two racks crosses the spine. In network order (members
  sorted by rack) the ring enters and leaves each rack once; an order that interleaves racks (a
  cyclic launch) crosses the spine up to ``R`` times.
- ``"two_hop"``: a ring inside each rack (``r`` members, ``M`` bytes), then rings across racks
  among the members at the same position in their rack (``P`` members, ``M / r`` bytes). An
  all-reduce is a reduce-scatter inside the rack, an all-reduce across racks and an all-gather
  inside the rack; a reduce-scatter is the first two with a reduce-scatter across; an all-gather
  is the last two with an all-gather across. A rack's uplink carries ``2 (P-1)/P * M`` per
  all-reduce instead of the flat network-order ring's ``2 (R-1)/R * M``.

[Note: what the byte counts count]
:func:`link_loads` gives, per link, the payload bytes that leave through it in one direction: a
member's host link (everything the member sends to another host), a rack's uplink (every ring edge
from a member of that rack to a member of another rack), a pod's uplink (edges from one pod to
another). Each ring edge carries ``ring_factor(kind, n) * buffer`` (every member of a ring sends
that much to its successor). Every ring enters a rack as often as it leaves it, so each link
receives what it sends: a counter of either direction of a rack's uplink (``tx_bytes`` of its
interface) reads the same, plus protocol headers, which are not counted. :func:`level_bytes` sums
each level over its links (``"node"``, ``"spine"``, ``"pod"``) and gives its most loaded link
(``"node_max"``, ...). Members sharing a host are not modelled: one member per host.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Sequence

from hybridshard.comm_bytes import ring_factor

__all__ = [
    "FORMS", "REDUCE_KINDS", "LinkLoads", "LinkRates", "block_order", "choose_rack_reduce", "cyclic_order",
    "level_bytes", "link_loads", "network_order", "predict_time",
]

FORMS = ("flat", "two_hop")
REDUCE_KINDS = ("all_reduce", "reduce_scatter", "all_gather")
_LEVELS = ("node", "spine", "pod")
_BITS = {"bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
_BYTES = {"bps": 1, "kbps": 1e3, "mbps": 1e6, "gbps": 1e9, "tbps": 1e12}
_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "ns": 1e-9}
_TIE = 1e-9  # relative: times equal up to rounding are a tie, and a tie keeps the flat ring


def _positive(name: str, value: float | None, *, optional: bool = False, zero: bool = False) -> None:
    if value is None and optional:
        return
    ok = value is not None and math.isfinite(value) and (value >= 0 if zero else value > 0)
    if not ok:
        raise ValueError(f"{name} must be a {'non-negative' if zero else 'positive'} finite number, found {value!r}; "
                         "pass it in the unit its name says")


@dataclass(frozen=True)
class LinkRates:
    """Per-direction rates of each level, and the latency of one ring step on it."""

    node_bytes_per_s: float
    """A member's host link (its NIC to the rack's switch), one direction."""
    spine_bytes_per_s: float
    """A rack's uplink to the spine, one direction, shared by the rack's hosts."""
    pod_bytes_per_s: float | None = None
    """A pod's uplink, one direction; needed only when racks are grouped in pods."""
    node_latency_s: float = 0.0
    """Seconds per step of a ring that stays inside racks (the alpha of the alpha-beta model)."""
    spine_latency_s: float = 0.0
    """Seconds per step of a ring that crosses racks."""
    pod_latency_s: float = 0.0
    """Seconds per step of a ring that crosses pods."""

    def __post_init__(self) -> None:
        _positive("node_bytes_per_s", self.node_bytes_per_s)
        _positive("spine_bytes_per_s", self.spine_bytes_per_s)
        _positive("pod_bytes_per_s", self.pod_bytes_per_s, optional=True)
        for name in ("node_latency_s", "spine_latency_s", "pod_latency_s"):
            _positive(name, getattr(self, name), zero=True)

    @classmethod
    def from_gbps(cls, *, node_gbps: float, rack_hosts: int, oversubscription: float = 1.0,
                  spine_gbps: float | None = None, pod_gbps: float | None = None, node_latency_s: float = 0.0,
                  spine_latency_s: float = 0.0, pod_latency_s: float = 0.0) -> "LinkRates":
        """From gigabits per second; the uplink is ``spine_gbps``, else
        ``rack_hosts * node_gbps / oversubscription``."""
        _positive("oversubscription", oversubscription)
        if rack_hosts < 1:
            raise ValueError(f"rack_hosts must be >= 1, found {rack_hosts}; pass the hosts that share a rack's uplink")
        spine = spine_gbps if spine_gbps is not None else rack_hosts * node_gbps / oversubscription
        return cls(node_bytes_per_s=node_gbps * 1e9 / 8, spine_bytes_per_s=spine * 1e9 / 8,
                   pod_bytes_per_s=None if pod_gbps is None else pod_gbps * 1e9 / 8, node_latency_s=node_latency_s,
                   spine_latency_s=spine_latency_s, pod_latency_s=pod_latency_s)

    @classmethod
    def from_busbw(cls, node_busbw: float, spine_busbw: float, *, per_rack: int = 1,
                   node_latency_s: float = 0.0, spine_latency_s: float = 0.0) -> "LinkRates":
        """From measured bus bandwidths in bytes per second (``BandwidthRow.busbw_gbps`` is GB/s: times 1e9).

        ``node_busbw``: of a ring inside one rack (every edge a host link). ``spine_busbw``: of a ring
        with one member per rack, measured while ``per_rack`` such rings ran at once (one per position
        in the rack, as two hops run them), so each uplink carried ``per_rack`` of them. A ring's
        busbw is what each of its links carried per second; the uplink is taken as ``per_rack`` times
        that, a lower bound when the host links, not the uplink, limited the measurement.
        """
        if per_rack < 1:
            raise ValueError(f"per_rack must be >= 1, found {per_rack}; pass the across-rack rings that ran at once")
        return cls(node_bytes_per_s=node_busbw, spine_bytes_per_s=spine_busbw * per_rack,
                   node_latency_s=node_latency_s, spine_latency_s=spine_latency_s)

    @classmethod
    def parse(cls, text: str, *, per_rack: int = 1) -> "LinkRates":
        """``"node=100gbit,spine=50gbit"``: rates in tc(8)'s units (``bit``/``kbit``/``mbit``/``gbit``/``tbit``
        per second; ``bps``/``kbps``/``mbps``/``gbps``/``tbps`` are bytes per second), latencies as
        ``node_latency=5us`` (s, ms, us, ns). Without ``spine``, the uplink is ``per_rack * node /
        oversubscription`` (``oversubscription=7``; default 1)."""
        fields: dict[str, str] = {}
        for item in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = item.partition("=")
            if not sep or key.strip() in fields:
                raise ValueError(f"link rates: expected comma-separated key=value pairs, each key once, "
                                 f"found {text!r}; e.g. node=100gbit,spine=50gbit")
            fields[key.strip()] = value.strip().lower()
        known = {"node", "spine", "pod", "oversubscription", "node_latency", "spine_latency", "pod_latency"}
        if "node" not in fields or set(fields) - known:
            raise ValueError(f"link rates: expected a node rate and keys among {sorted(known)}, found {sorted(fields)} "
                             f"in {text!r}; e.g. node=100gbit,spine=50gbit")
        bits = {**_BITS, **{k: v * 8 for k, v in _BYTES.items()}}
        rate = lambda key: _quantity(fields[key], bits, key) / 8  # noqa: E731
        latency = lambda key: _quantity(fields.get(key, "0s"), _SECONDS, key)  # noqa: E731
        node = rate("node")
        over = _quantity(fields.get("oversubscription", "1"), {"": 1.0}, "oversubscription")
        return cls(node_bytes_per_s=node,
                   spine_bytes_per_s=rate("spine") if "spine" in fields else per_rack * node / over,
                   pod_bytes_per_s=rate("pod") if "pod" in fields else None, node_latency_s=latency("node_latency"),
                   spine_latency_s=latency("spine_latency"), pod_latency_s=latency("pod_latency"))


def _quantity(text: str, units: dict[str, float], key: str) -> float:
    m = re.fullmatch(r"([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)", text)
    if m is None or m.group(2) not in units:
        raise ValueError(f"link rates: expected {key}=<number><unit> with a unit among {sorted(units)}, "
                         f"found {text!r}; e.g. node=100gbit or spine_latency=20us")
    return float(m.group(1)) * units[m.group(2)]


@dataclass(frozen=True)
class LinkLoads:
    """Bytes out of each link in one direction; see [Note: what the byte counts count]."""

    node: tuple[float, ...]
    """Per member, in group-rank order."""
    spine: tuple[float, ...]
    """Per rack."""
    pod: tuple[float, ...] = ()
    """Per pod; empty without pods."""


@dataclass(frozen=True)
class _Phase:
    rings: tuple[tuple[int, ...], ...]
    """Members (group ranks) of each ring that runs in this phase, in ring order."""
    edge_bytes: float
    """Bytes each ring edge carries per byte of ``nbytes``."""
    steps: int
    across: bool
    """The phase of two hops that runs across racks (for the pipeline of [Note: the cost model])."""


def cyclic_order(racks: int, per_rack: int) -> list[int]:
    """Racks of the members when a launch deals them out round-robin: 0, 1, ..., P-1, 0, 1, ..."""
    return [m % racks for m in range(racks * per_rack)]


def block_order(racks: int, per_rack: int) -> list[int]:
    """Racks of the members in blocks: rack 0's ``per_rack`` members first (network order)."""
    return [m // per_rack for m in range(racks * per_rack)]


def network_order(order: Sequence[int]) -> list[int]:
    """``order`` with the members sorted by rack: the ring enters and leaves each rack once."""
    return sorted(order)


def _check(form: str, kind: str, racks: int, per_rack: int, order: Sequence[int] | None,
           racks_per_pod: int | None) -> list[int]:
    if form not in FORMS:
        raise ValueError(f"form must be one of {FORMS}, found {form!r}; use one of those names")
    if kind not in REDUCE_KINDS:
        raise ValueError(f"kind must be one of {REDUCE_KINDS}, found {kind!r}; use one of those names")
    if not (isinstance(racks, int) and isinstance(per_rack, int) and racks >= 1 and per_rack >= 1):
        raise ValueError(f"racks and per_rack must be integers >= 1, found {racks!r} and {per_rack!r}; "
                         "pass the racks the group spans and its members in each")
    if racks_per_pod is not None and (racks_per_pod < 1 or racks % racks_per_pod):
        raise ValueError(f"racks_per_pod must divide racks ({racks}), found {racks_per_pod}; pass a divisor or None")
    order = block_order(racks, per_rack) if order is None else list(order)
    counts = [order.count(p) for p in range(racks)]
    if len(order) != racks * per_rack or counts != [per_rack] * racks:
        raise ValueError(f"order must name each rack 0..{racks - 1} exactly {per_rack} times (the rack of each "
                         f"member), found {order[:16]}{'...' if len(order) > 16 else ''}; pass one rack index per member")
    return order


def _phases(form: str, kind: str, racks: int, per_rack: int, order: list[int]) -> list[_Phase]:
    n = racks * per_rack
    if form == "flat":
        steps = (2 if kind == "all_reduce" else 1) * (n - 1)
        return [_Phase((tuple(range(n)),), ring_factor(kind, n), steps, across=False)]
    members = [[m for m in range(n) if order[m] == p] for p in range(racks)]
    inside = tuple(tuple(ms) for ms in members)
    across = tuple(tuple(members[p][j] for p in range(racks)) for j in range(per_rack))
    rs_in = _Phase(inside, ring_factor("reduce_scatter", per_rack), per_rack - 1, across=False)
    ag_in = _Phase(inside, ring_factor("all_gather", per_rack), per_rack - 1, across=False)
    cross = _Phase(across, ring_factor(kind, racks) / per_rack, (2 if kind == "all_reduce" else 1) * (racks - 1),
                   across=True)
    return {"all_reduce": [rs_in, cross, ag_in], "reduce_scatter": [rs_in, cross], "all_gather": [cross, ag_in]}[kind]


def _loads(phase: _Phase, order: list[int], racks: int, racks_per_pod: int | None) -> tuple[list[float], ...]:
    """Bytes out of each link per byte of the buffer for one phase: (per member, per rack, per pod)."""
    pod_of = (lambda p: p // racks_per_pod) if racks_per_pod else (lambda p: 0)  # noqa: E731
    node, spine = [0.0] * len(order), [0.0] * racks
    pod = [0.0] * (racks // racks_per_pod if racks_per_pod else 0)
    for ring in phase.rings:
        if len(ring) < 2:
            continue
        for a, b in zip(ring, ring[1:] + ring[:1]):
            node[a] += phase.edge_bytes
            if order[a] != order[b]:
                spine[order[a]] += phase.edge_bytes
                if pod_of(order[a]) != pod_of(order[b]):
                    pod[pod_of(order[a])] += phase.edge_bytes
    return node, spine, pod


def link_loads(form: str, *, racks: int, per_rack: int, nbytes: float, kind: str = "all_reduce",
               order: Sequence[int] | None = None, racks_per_pod: int | None = None) -> LinkLoads:
    """Bytes out of every link for one collective over ``nbytes`` (its full buffer); ``order``: the
    rack of each member in group-rank order (default :func:`block_order`); racks ``k * racks_per_pod``
    onwards form pod ``k``. See [Note: what the byte counts count]."""
    checked = _check(form, kind, racks, per_rack, order, racks_per_pod)
    _positive("nbytes", nbytes, zero=True)
    node, spine, pod = [0.0] * len(checked), [0.0] * racks, [0.0] * (racks // racks_per_pod if racks_per_pod else 0)
    for phase in _phases(form, kind, racks, per_rack, checked):
        for total, part in zip((node, spine, pod), _loads(phase, checked, racks, racks_per_pod)):
            for i, v in enumerate(part):
                total[i] += v * nbytes
    return LinkLoads(node=tuple(node), spine=tuple(spine), pod=tuple(pod))


def level_bytes(form: str, *, racks: int, per_rack: int, nbytes: float, kind: str = "all_reduce",
                order: Sequence[int] | None = None, racks_per_pod: int | None = None) -> dict[str, float]:
    """Bytes through each level for one collective: ``"node"``, ``"spine"`` (and ``"pod"`` with pods)
    summed over the level's links, ``"<level>_max"`` its most loaded link; one direction, payload only
    ([Note: what the byte counts count])."""
    loads = link_loads(form, racks=racks, per_rack=per_rack, nbytes=nbytes, kind=kind, order=order,
                       racks_per_pod=racks_per_pod)
    out: dict[str, float] = {}
    for level in _LEVELS:
        links = getattr(loads, level)
        if level != "pod" or racks_per_pod:
            out[level], out[f"{level}_max"] = sum(links), max(links, default=0.0)
    return out


def _phase_costs(form: str, kind: str, racks: int, per_rack: int, order: list[int], rates: LinkRates,
                 racks_per_pod: int | None) -> tuple[list[tuple[float, float, bool]], list[float]]:
    """``(alpha, seconds per byte, across)`` of each phase, and each link's seconds per byte over all phases."""
    if racks_per_pod and rates.pod_bytes_per_s is None:
        raise ValueError("racks_per_pod needs LinkRates.pod_bytes_per_s, found None; pass the pods' uplink rate")
    level_rate = (rates.node_bytes_per_s, rates.spine_bytes_per_s, rates.pod_bytes_per_s or 1.0)
    level_alpha = (rates.node_latency_s, rates.spine_latency_s, rates.pod_latency_s)
    out, busy = [], None
    for phase in _phases(form, kind, racks, per_rack, order):
        levels = _loads(phase, order, racks, racks_per_pod)
        per_link = [v / rate for links, rate in zip(levels, level_rate) for v in links]
        busy = per_link if busy is None else [a + b for a, b in zip(busy, per_link)]
        top = max((i for i, links in enumerate(levels) if any(links)), default=0)
        out.append((phase.steps * level_alpha[top], max(per_link, default=0.0), phase.across))
    return out, busy or [0.0]


def predict_time(form: str, *, racks: int, per_rack: int, unit_bytes: Sequence[float], rates: LinkRates,
                 kind: str = "all_reduce", order: Sequence[int] | None = None, overlap: bool = True,
                 racks_per_pod: int | None = None) -> float:
    """Seconds to run one collective of ``kind`` per unit, ``unit_bytes[u]`` its full buffer, in ``form``.

    [Note: the cost model]
    A ring phase of one unit takes ``steps * alpha + max over links (bytes out of the link / its
    rate)``: the ring is pipelined, so its most loaded link sets the pace (an uplink carries all of
    its rack's crossing edges, a host link its own member's). ``alpha`` is the latency of the
    highest level a ring edge crosses. A flat ring runs its units one after another on the same
    links: the sum. Two hops with ``overlap=False`` sum their phases too. With ``overlap`` (the
    default), the phases inside racks of unit ``u + 1`` run while unit ``u`` crosses the racks: a
    two-stage pipeline (inside / across), costed as the busier stage's total plus one unit's other
    stage (fill and drain, the largest unit's), and never less than the busiest link's total time
    (host links carry both stages). Links are shared fairly and phases interleave perfectly; NCCL's
    channels, protocols and tree algorithms are not modelled. It ranks forms; it is not a step time.
    """
    checked = _check(form, kind, racks, per_rack, order, racks_per_pod)
    for nbytes in unit_bytes:
        _positive("unit_bytes", nbytes, zero=True)
    phases, busy = _phase_costs(form, kind, racks, per_rack, checked, rates, racks_per_pod)
    times = [[alpha + beta * nbytes for alpha, beta, _ in phases] for nbytes in unit_bytes]
    if not times:
        return 0.0
    if not overlap or len(phases) == 1:
        return sum(map(sum, times))
    across = [a for _, _, a in phases]
    stage = {flag: sum(t for row in times for t, a in zip(row, across) if a == flag) for flag in (True, False)}
    slow = max(stage, key=stage.get)
    fill = max(sum(t for t, a in zip(row, across) if a != slow) for row in times)
    link_bound = max(busy) * sum(unit_bytes)
    return max(stage[slow] + fill, link_bound)


def choose_rack_reduce(*, racks: int, per_rack: int, unit_bytes: Sequence[float], rates: LinkRates,
                       kind: str = "all_reduce", order: Sequence[int] | None = None,
                       overlap: bool = True) -> tuple[bool, str]:
    """``(True, reason)`` when two hops are predicted faster than the flat ring in ``order`` (default:
    network order, the flat ring's best), ``(False, reason)`` otherwise (a tie included) or when there
    is nothing to split (one rack, or one member per rack)."""
    if racks == 1 or per_rack == 1:
        _check("flat", kind, racks, per_rack, order, None)
        what = "one rack" if racks == 1 else "one member per rack"
        return False, f"{what}: two hops would be the flat ring"
    kw = dict(racks=racks, per_rack=per_rack, unit_bytes=unit_bytes, rates=rates, kind=kind, order=order)
    flat, two = predict_time("flat", **kw), predict_time("two_hop", overlap=overlap, **kw)
    return two < flat * (1 - _TIE), f"two hops {two:.3g} s vs flat {flat:.3g} s"
