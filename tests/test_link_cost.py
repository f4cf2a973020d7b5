"""hybridshard.link_cost: bytes per network level of a flat ring and of two hops, against hand counts
and a ring simulated chunk by chunk, and the cost model's choice between them."""

from __future__ import annotations

import random

import pytest

from hybridshard import link_cost as L

M = 1000.0  # bytes of the collective's buffer


def test_two_racks_of_two_by_hand():
    # Ring all-reduce over 4 members: every member sends 2 * 3/4 * M = 1.5 M to its successor.
    # Cyclic order 0,1,0,1: all 4 edges cross the spine; each rack sends 2 of them up its uplink.
    cyclic = L.level_bytes("flat", racks=2, per_rack=2, nbytes=M, order=L.cyclic_order(2, 2))
    assert L.cyclic_order(2, 2) == [0, 1, 0, 1]
    assert cyclic == {"node": 6 * M, "node_max": 1.5 * M, "spine": 6 * M, "spine_max": 3 * M}
    # Network order 0,0,1,1: edges 1->2 and 3->0 cross, one per rack.
    network = L.level_bytes("flat", racks=2, per_rack=2, nbytes=M, order=L.network_order([0, 1, 0, 1]))
    assert network == {"node": 6 * M, "node_max": 1.5 * M, "spine": 3 * M, "spine_max": 1.5 * M}
    # Two hops: RS inside (each sends M/2), all-reduce of M/2 across (2 rings of 2: each member sends
    # 2 * 1/2 * M/2 = M/2 across), AG inside (M/2): 1.5 M per member, M up each uplink.
    two = L.level_bytes("two_hop", racks=2, per_rack=2, nbytes=M, order=[0, 1, 0, 1])
    assert two == {"node": 6 * M, "node_max": 1.5 * M, "spine": 2 * M, "spine_max": 1 * M}
    assert two["spine"] / network["spine"] == pytest.approx(2 / 3)  # (P-1) R / (P) = 1 * 4 / (2 * 3)


@pytest.mark.parametrize("racks,per_rack", [(2, 2), (2, 8), (3, 4), (4, 1), (8, 4), (5, 3), (1, 6)])
def test_general_formulas(racks, per_rack):
    n = racks * per_rack
    flat = L.level_bytes("flat", racks=racks, per_rack=per_rack, nbytes=M)
    two = L.level_bytes("two_hop", racks=racks, per_rack=per_rack, nbytes=M)
    cyc = L.level_bytes("flat", racks=racks, per_rack=per_rack, nbytes=M, order=L.cyclic_order(racks, per_rack))
    each = 2 * (n - 1) / n * M
    assert flat["node_max"] == pytest.approx(each) and two["node_max"] == pytest.approx(each)  # same host bytes
    assert flat["spine_max"] == pytest.approx(each if racks > 1 else 0)  # enters and leaves each rack once
    assert two["spine_max"] == pytest.approx(2 * (racks - 1) / racks * M)  # per_rack * 2(P-1)/P * M/per_rack
    assert cyc["spine"] == pytest.approx((n * each) if racks > 1 else 0)  # every edge crosses
    if racks > 1:
        assert two["spine"] / flat["spine"] == pytest.approx((racks - 1) * n / (racks * (n - 1)))
    for kind in ("reduce_scatter", "all_gather"):  # each half of the all-reduce
        for form in L.FORMS:
            half = L.level_bytes(form, racks=racks, per_rack=per_rack, nbytes=M, kind=kind)
            full = L.level_bytes(form, racks=racks, per_rack=per_rack, nbytes=M)
            assert half == pytest.approx({k: v / 2 for k, v in full.items()})


def _simulate(form, kind, racks, per_rack, order, racks_per_pod):
    """Bytes out of each rack's uplink and pod's uplink, chunk by chunk along the rings."""
    pod = (lambda p: p // racks_per_pod) if racks_per_pod else (lambda p: 0)
    spine, pods = [0.0] * racks, [0.0] * (racks // racks_per_pod if racks_per_pod else 0)

    def ring(members, buffer, what):
        n = len(members)
        steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}[what]
        for _ in range(steps):
            for i, a in enumerate(members):
                b = members[(i + 1) % n]
                if order[a] != order[b]:
                    spine[order[a]] += buffer / n
                    if pod(order[a]) != pod(order[b]):
                        pods[pod(order[a])] += buffer / n

    n = racks * per_rack
    if form == "flat":
        ring(list(range(n)), M, kind)
    else:
        inside = [[m for m in range(n) if order[m] == p] for p in range(racks)]
        across = [[inside[p][j] for p in range(racks)] for j in range(per_rack)]
        plan = {"all_reduce": [("in", "reduce_scatter"), ("across", "all_reduce"), ("in", "all_gather")],
                "reduce_scatter": [("in", "reduce_scatter"), ("across", "reduce_scatter")],
                "all_gather": [("across", "all_gather"), ("in", "all_gather")]}[kind]
        for where, what in plan:
            for members in (inside if where == "in" else across):
                ring(members, M if where == "in" else M / per_rack, what)
    return spine, pods


def test_random_orders_match_a_simulated_ring():
    rng = random.Random(0)
    for _ in range(60):
        racks_per_pod = rng.choice([None, 1, 2])
        racks = rng.choice([2, 4, 6]) if racks_per_pod else rng.randint(1, 5)
        per_rack = rng.randint(1, 5)
        order = L.block_order(racks, per_rack)
        rng.shuffle(order)
        for form in L.FORMS:
            for kind in L.REDUCE_KINDS:
                spine, pods = _simulate(form, kind, racks, per_rack, order, racks_per_pod)
                loads = L.link_loads(form, racks=racks, per_rack=per_rack, nbytes=M, kind=kind, order=order,
                                     racks_per_pod=racks_per_pod)
                assert loads.spine == pytest.approx(spine), (form, kind, order)
                assert loads.pod == pytest.approx(pods), (form, kind, order)
                levels = L.level_bytes(form, racks=racks, per_rack=per_rack, nbytes=M, kind=kind, order=order,
                                       racks_per_pod=racks_per_pod)
                assert levels["spine"] == pytest.approx(sum(spine))
                assert ("pod" in levels) == bool(racks_per_pod)


def _rates(spine: float, **kw) -> L.LinkRates:
    return L.LinkRates(node_bytes_per_s=1.0, spine_bytes_per_s=spine, **kw)


def test_predict_time_by_hand():
    # 2 x 2, 100 units of M = 1 byte, host links 1 B/s, uplinks 0.5 B/s, no latency.
    kw = dict(racks=2, per_rack=2, unit_bytes=[1.0] * 100, rates=_rates(0.5))
    assert L.predict_time("flat", **kw) == pytest.approx(100 * 1.5 / 0.5)  # uplink-bound: 1.5 B per unit
    # Inside: RS + AG, 0.5 B each on the host link; across: 1 B up each uplink at 0.5 B/s = 2 s per unit.
    assert L.predict_time("two_hop", overlap=False, **kw) == pytest.approx(100 * (0.5 + 2 + 0.5))
    assert L.predict_time("two_hop", **kw) == pytest.approx(100 * 2 + 1.0)  # across stage + one unit's inside
    lat = dict(kw, unit_bytes=[0.0], rates=_rates(0.5, node_latency_s=1e-3, spine_latency_s=1e-2))
    assert L.predict_time("flat", **lat) == pytest.approx(6 * 1e-2)  # 2(R-1) steps crossing racks
    assert L.predict_time("two_hop", overlap=False, **lat) == pytest.approx(2 * 1e-3 + 2 * 1e-2)
    assert L.predict_time("flat", **dict(kw, unit_bytes=[])) == 0.0


def test_a_slower_spine_never_favours_the_flat_ring():
    for racks, per_rack in [(2, 2), (4, 4), (8, 2), (3, 5)]:
        units = [1.0, 3.0, 2.0] * 10
        rates = [4.0, 2.0, 1.0, 0.5, 0.25, 0.1]
        lat = dict(node_latency_s=1e-3, spine_latency_s=5e-3)
        ratios = [L.predict_time("flat", racks=racks, per_rack=per_rack, unit_bytes=units, rates=_rates(s, **lat))
                  / L.predict_time("two_hop", racks=racks, per_rack=per_rack, unit_bytes=units, rates=_rates(s, **lat))
                  for s in rates]
        assert ratios == sorted(ratios), (racks, per_rack, ratios)


def test_choice_flips_where_the_flat_ring_becomes_uplink_bound():
    # 2 x 2, host links 1 B/s: the flat network-order ring is host-bound (1.5 B per unit at 1 B/s)
    # until the uplink drops below 1 B/s; two hops (1.5 B per unit on the host link too) then win, never before.
    kw = dict(racks=2, per_rack=2, unit_bytes=[1.0] * 100)
    assert L.choose_rack_reduce(rates=_rates(1.01), **kw)[0] is False
    assert L.choose_rack_reduce(rates=_rates(1.0), **kw)[0] is False  # a tie keeps the flat ring
    two, why = L.choose_rack_reduce(rates=_rates(0.99), **kw)
    assert two is True and why == "two hops 150 s vs flat 152 s"  # host-bound vs uplink-bound
    # A launch that interleaves racks crosses the spine at every hop: two hops win at 1.01 already.
    assert L.choose_rack_reduce(rates=_rates(1.01), order=L.cyclic_order(2, 2), **kw)[0] is True
    assert L.choose_rack_reduce(rates=_rates(0.1), racks=1, per_rack=4, unit_bytes=[1.0]) == (
        False, "one rack: two hops would be the flat ring")
    assert L.choose_rack_reduce(rates=_rates(0.1), racks=4, per_rack=1, unit_bytes=[1.0])[0] is False


def test_rates_from_gbps_busbw_and_text():
    r = L.LinkRates.from_gbps(node_gbps=100, rack_hosts=8, oversubscription=4)
    assert (r.node_bytes_per_s, r.spine_bytes_per_s) == (12.5e9, 25e9)
    assert L.LinkRates.from_gbps(node_gbps=100, rack_hosts=8, spine_gbps=40).spine_bytes_per_s == 5e9
    b = L.LinkRates.from_busbw(3e9, 1e9, per_rack=4)
    assert (b.node_bytes_per_s, b.spine_bytes_per_s) == (3e9, 4e9)
    p = L.LinkRates.parse("node=100gbit, spine=50gbit, spine_latency=20us", per_rack=4)
    assert (p.node_bytes_per_s, p.spine_bytes_per_s, p.spine_latency_s) == (12.5e9, 6.25e9, pytest.approx(2e-5))
    q = L.LinkRates.parse("node=1gbps,oversubscription=2", per_rack=4)  # tc: gbps is gigabytes per second
    assert (q.node_bytes_per_s, q.spine_bytes_per_s) == (1e9, 2e9)


@pytest.mark.parametrize("call,needle", [
    (lambda: L.level_bytes("ring", racks=2, per_rack=2, nbytes=M), "form must be one of"),
    (lambda: L.level_bytes("flat", racks=2, per_rack=2, nbytes=M, kind="broadcast"), "kind must be one of"),
    (lambda: L.level_bytes("flat", racks=0, per_rack=2, nbytes=M), "racks and per_rack must be integers"),
    (lambda: L.level_bytes("flat", racks=2, per_rack=2, nbytes=M, order=[0, 0, 0, 1]), "order must name each rack"),
    (lambda: L.level_bytes("flat", racks=2, per_rack=2, nbytes=-1.0), "nbytes must be a non-negative"),
    (lambda: L.level_bytes("flat", racks=3, per_rack=2, nbytes=M, racks_per_pod=2), "racks_per_pod must divide"),
    (lambda: L.predict_time("flat", racks=2, per_rack=2, unit_bytes=[1.0], rates=_rates(1.0), racks_per_pod=1),
     "needs LinkRates.pod_bytes_per_s"),
    (lambda: L.predict_time("flat", racks=2, per_rack=2, unit_bytes=[float("nan")], rates=_rates(1.0)),
     "unit_bytes must be"),
    (lambda: _rates(0.0), "spine_bytes_per_s must be a positive"),
    (lambda: _rates(1.0, node_latency_s=-1.0), "node_latency_s must be a non-negative"),
    (lambda: L.LinkRates.from_gbps(node_gbps=100, rack_hosts=0), "rack_hosts must be >= 1"),
    (lambda: L.LinkRates.from_gbps(node_gbps=100, rack_hosts=2, oversubscription=0), "oversubscription must be"),
    (lambda: L.LinkRates.from_busbw(1e9, 1e9, per_rack=0), "per_rack must be >= 1"),
    (lambda: L.LinkRates.parse("node=100gbit,node=1gbit"), "comma-separated key=value pairs"),
    (lambda: L.LinkRates.parse("spine=100gbit"), "expected a node rate"),
    (lambda: L.LinkRates.parse("node=100gbit,uplink=1gbit"), "expected a node rate and keys among"),
    (lambda: L.LinkRates.parse("node=100furlongs"), "expected node=<number><unit>"),
    (lambda: L.choose_rack_reduce(racks=1, per_rack=2, unit_bytes=[1.0], rates=_rates(1.0), kind="x"),
     "kind must be one of"),
])
def test_errors_name_what_was_expected(call, needle):
    with pytest.raises(ValueError, match=needle):
        call()
