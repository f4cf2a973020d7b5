"""`hybridshard plan --racks`: bytes per network level and the flat / two-hop times of the replicate
reduction, from synthetic racks and from the nodes' network paths."""

from __future__ import annotations

import json

import pytest

from hybridshard import link_cost as L
from hybridshard.cli import main
from hybridshard.topology.synthetic import synthetic_cluster

# 7e9 parameters in 32 units: each unit's gradient shard over 8 GPUs is 218_750_000 / 8 fp32 elements.
SHARD_BYTES = 218_750_000 // 8 * 4
BASE = ["plan", "--model-params", "7e9", "--nodes", "8", "--gpus-per-node", "8"]


def _json(capsys, *extra):
    assert main([*BASE, *extra, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _option(data, strategy, shard_size, optim=False):
    return next(o for o in data["options"] if o["strategy"] == strategy and o["shard_size"] == shard_size
                and o["shard_optimizer_across_replicas"] == optim)


@pytest.mark.parametrize("layout,order", [("block", L.block_order(4, 2)), ("cyclic", L.cyclic_order(4, 2))])
def test_json_bytes_are_link_costs_over_every_replicate_group(capsys, layout, order):
    data = _json(capsys, "--racks", "4", "--rack-layout", layout, "--spine-oversubscription", "7")
    assert data["racks"]["node_racks"] == [order[n] for n in range(8)]
    racks = _option(data, "HYBRID_SHARD", 8)["racks"]
    assert (racks["racks"], racks["per_rack"], racks["replicate_groups"], racks["skipped"]) == (4, 2, 8, None)
    total = 32 * SHARD_BYTES
    for label, form, o in (("flat_launch", "flat", order), ("flat_network", "flat", None), ("two_hop", "two_hop", None)):
        one = L.level_bytes(form, racks=4, per_rack=2, nbytes=total, order=o)
        assert racks["level_bytes"][label] == pytest.approx(
            {"node": 8 * one["node"], "node_max": one["node_max"], "spine": 8 * one["spine"],
             "spine_max": 8 * one["spine_max"]})
    # One group's share of a 1:7 uplink: 2 nodes x 200 Gb/s / 7; see [Note: one replicate group's share].
    rates = L.LinkRates.from_gbps(node_gbps=200, rack_hosts=2, oversubscription=7)
    units = [SHARD_BYTES] * 32
    assert racks["seconds"]["flat_launch"] == pytest.approx(
        L.predict_time("flat", racks=4, per_rack=2, unit_bytes=units, rates=rates, order=order))
    assert racks["seconds"]["two_hop"] == pytest.approx(
        L.predict_time("two_hop", racks=4, per_rack=2, unit_bytes=units, rates=rates))
    two, why = L.choose_rack_reduce(racks=4, per_rack=2, unit_bytes=units, rates=rates)
    assert racks["rack_reduce_none_picks"] == [{"kind": "all_reduce", "two_hop": two, "reason": why}]
    assert two is True
    assert _option(data, "FULL_SHARD", 64)["racks"] is None
    assert "shard size 4 puts several members" in _option(data, "HYBRID_SHARD", 4)["racks"]["skipped"]
    optim = _option(data, "HYBRID_SHARD", 8, optim=True)
    assert optim["racks"]["kinds"] == ["reduce_scatter", "all_gather"]
    for option in (optim, _option(data, "HYBRID_SHARD", 8)):  # a GPU's link sends what the sizing table says
        for levels in option["racks"]["level_bytes"].values():
            assert levels["node_max"] == pytest.approx(option["link_bytes"]["inter_node"])


def test_text_shows_the_recommended_option_per_form(capsys):
    assert main([*BASE, "--racks", "4", "--rack-layout", "cyclic", "--spine-oversubscription", "7"]) == 0
    out = capsys.readouterr().out
    assert "racks: 4 racks x 2 nodes (--racks 4, nodes dealt round-robin); a rack's uplink 457.143 Gb/s" in out
    assert "replicate reduction of HYBRID_SHARD+optim 8 x 8, per step, 8 replicate groups at once" in out
    rows = {line.split("  ")[1]: line.split()[-4:] for line in out.splitlines()
            if line.startswith("  flat") or line.startswith("  two hops")}
    # The cyclic launch crosses the spine at every hop: twice the network order's uplink bytes (2 per rack).
    assert float(rows["flat, launch order"][1]) == pytest.approx(2 * float(rows["flat, network order"][1]))
    assert float(rows["two hops"][1]) / float(rows["flat, network order"][1]) == pytest.approx(3 * 8 / (4 * 7), abs=1e-3)
    assert "rack_reduce=None picks two hops for the reduce-scatter: two hops" in out
    assert "rack_reduce=None picks two hops for the all-gather" in out


def test_without_oversubscription_the_flat_ring_is_kept(capsys):
    racks = _option(_json(capsys, "--racks", "4"), "HYBRID_SHARD", 8)["racks"]
    assert racks["rack_reduce_none_picks"][0]["two_hop"] is False  # host links, not uplinks, set the pace
    assert racks["seconds"]["flat_network"] == pytest.approx(racks["seconds"]["two_hop"])  # same host-link bytes


def test_racks_from_the_nodes_network_paths(tmp_path, capsys):
    view = synthetic_cluster(4, 8).to_dict()
    for n, node in enumerate(view["nodes"]):
        node["probe"]["network_path"] = ["pod0", f"rack{n % 2}"]
    path = tmp_path / "view.json"
    path.write_text(json.dumps({"cluster": view}))
    assert main(["plan", "--from", str(path), "--model-params", "7e9", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["racks"]["rack_names"] == ["pod0/rack0", "pod0/rack1"]
    assert data["racks"]["node_racks"] == [0, 1, 0, 1]
    levels = _option(data, "HYBRID_SHARD", 8)["racks"]["level_bytes"]
    assert levels["flat_launch"]["spine"] == pytest.approx(2 * levels["flat_network"]["spine"])
    view["nodes"][3]["probe"]["network_path"] = []
    path.write_text(json.dumps({"cluster": view}))
    assert main(["plan", "--from", str(path), "--model-params", "7e9"]) == 2
    assert "expected a network path for every node, found none for node3" in capsys.readouterr().err


@pytest.mark.parametrize("extra,needle", [
    (["--racks", "3"], "--racks: expected a number of racks that divides the 8 nodes, got 3"),
    (["--racks", "2", "--spine-oversubscription", "0"], "--spine-oversubscription must be a positive ratio"),
    (["--racks", "2", "--spine-gbps", "-1"], "--spine-gbps must be a positive number"),
])
def test_errors_exit_2_with_the_reason(capsys, extra, needle):
    assert main([*BASE, *extra]) == 2
    assert needle in capsys.readouterr().err


def test_rack_options_need_a_model(capsys):
    assert main(["plan", "--nodes", "8", "--racks", "4"]) == 2
    assert "add --model-params" in capsys.readouterr().err
