"""Sizing shard groups over k whole nodes: bytes out of a node (two hops against a flat ring), the
secondary shard's memory, racks, and the smallest k that fits (``hybridshard plan --multi-node``)."""

from __future__ import annotations

import json

import pytest

from hybridshard.cli import main
from hybridshard.estimates.multinode import node_counts, node_settings, recommend_nodes
from hybridshard.estimates.sizing import ClusterSpec, ModelSpec

GB = 10**9
H100 = 80 * GB
LLAMA_405B = dict(num_params=405 * GB, unit_params=405 * GB // 126)
LLAMA_8B = dict(num_params=8_030_000_000, unit_params=(8_030_000_000 - 1_050_000_000) // 32, root_params=1_050_000_000)


def _one(settings, k, optim=False, secondary=False):
    [found] = [s for s in settings if (s.nodes, s.shard_optimizer, s.secondary) == (k, optim, secondary)]
    return found


def test_405b_on_32_nodes_of_8_needs_shard_groups_over_nodes():
    cluster = ClusterSpec(node_sizes=(8,) * 32, gpu_memory_bytes=H100)
    settings = node_settings(model=ModelSpec(**LLAMA_405B, reduce_dtype="bf16"), cluster=cluster)
    rec = recommend_nodes(settings, cluster=cluster, headroom=0.10)
    assert rec.choice is not None and rec.choice.nodes > 1
    assert (rec.choice.nodes, rec.choice.shard_optimizer, rec.choice.secondary) == (8, True, False)
    assert all(s.peak > rec.budget for s in settings if s.nodes == 1)  # 101 GB of bf16 parameters per GPU at k = 1
    # fp32 reduction: only the whole job as one shard group fits, and only with 2 % kept free
    fp32 = node_settings(model=ModelSpec(**LLAMA_405B), cluster=cluster)
    assert recommend_nodes(fp32, cluster=cluster, headroom=0.10).choice is None
    assert "nothing fits in 72.0 GB" in recommend_nodes(fp32, cluster=cluster, headroom=0.10).reason
    assert recommend_nodes(fp32, cluster=cluster, headroom=0.04).choice is None
    assert recommend_nodes(fp32, cluster=cluster, headroom=0.02).choice.nodes == 32


def test_8b_on_8_nodes_of_8_stays_inside_the_node():
    cluster = ClusterSpec(node_sizes=(8,) * 8, gpu_memory_bytes=H100)
    rec = recommend_nodes(node_settings(model=ModelSpec(**LLAMA_8B), cluster=cluster), cluster=cluster)
    assert rec.choice.nodes == 1 and rec.choice.shard_size == 8


def test_two_hops_send_half_a_unit_out_of_each_of_2_nodes_against_the_flat_rings_three_quarters():
    model = ModelSpec(num_params=1000, unit_params=100, root_params=0, param_dtype="fp32", reduce_dtype="fp32")
    cluster = ClusterSpec(node_sizes=(2, 2), gpu_memory_bytes=H100)
    plain, node = _one(node_settings(model=model, cluster=cluster), 2), _one(node_settings(model=model, cluster=cluster), 2, secondary=True)
    moved = (2 * 1000 + 1000) * 4  # each unit gathered twice, every gradient reduce-scattered once; no replicas
    assert plain.node_bytes == pytest.approx(moved * 0.50)
    assert plain.node_bytes_flat == pytest.approx(moved * 0.75)
    assert node.node_bytes == pytest.approx((1000 + 1000) * 4 * 0.50)  # the backward's gather stays on the node
    assert node.node_bytes / plain.node_bytes == pytest.approx(2 / 3)


def test_replicate_reduction_leaves_the_node_from_every_gpu():
    model = ModelSpec(num_params=800, unit_params=100, param_dtype="fp32", reduce_dtype="fp32")
    cluster = ClusterSpec(node_sizes=(4,) * 4, gpu_memory_bytes=H100)
    k1 = _one(node_settings(model=model, cluster=cluster), 1)
    assert k1.node_bytes == pytest.approx(4 * 2 * 3 / 4 * 800 / 4 * 4)  # g ranks x all-reduce of N / S over R = 4
    k2 = _one(node_settings(model=model, cluster=cluster), 2, optim=True)
    shard_part = (2 * 800 + 800) * 4 / 2
    assert k2.node_bytes == pytest.approx(shard_part + 4 * (1 / 2 * 800 / 8 * 4) * 2)  # rs + ag over R = 2


def test_secondary_shard_adds_a_gth_of_every_unit_at_the_peak():
    model = ModelSpec(**LLAMA_405B, reduce_dtype="bf16")
    cluster = ClusterSpec(node_sizes=(8,) * 32, gpu_memory_bytes=H100)
    settings = node_settings(model=model, cluster=cluster)
    plain, node = _one(settings, 4, optim=True), _one(settings, 4, optim=True, secondary=True)
    full, rest = divmod(model.num_params, model.unit_params)  # 126 units and a last one of 36 elements
    assert (full, rest) == (126, 36)
    assert node.secondary_bytes == (126 * -(-model.unit_params // 8) + 5) * 2
    # the secondary shard replaces the hop across nodes' result, one per gather in flight (prefetch 1)
    assert plain.hop_bytes == 2 * -(-model.unit_params // 8) * 2 and node.hop_bytes == 0
    assert node.peak - plain.peak == node.secondary_bytes - plain.hop_bytes
    assert plain.secondary_bytes == 0


def test_racks_bound_k_and_carry_only_replicate_rings():
    model = ModelSpec(num_params=800, unit_params=100, param_dtype="fp32", reduce_dtype="fp32")
    cluster = ClusterSpec(node_sizes=(2,) * 4, gpu_memory_bytes=H100)
    assert node_counts(4) == [1, 2, 4] and node_counts(4, (2, 2)) == [1, 2] and node_counts(6, (3, 3)) == [1, 3]
    settings = node_settings(model=model, cluster=cluster, rack_sizes=(2, 2))
    assert {s.nodes for s in settings} == {1, 2}
    # k = 1: 2 replicate groups of 4 members, 2 a rack; each ring leaves a rack once: 2 x 2 (3/4) x 400 x 4
    assert _one(settings, 1).rack_bytes == pytest.approx(2 * 2 * 3 / 4 * 400 * 4)
    # k = 2: 4 replicate groups of 2 members, one a rack
    assert _one(settings, 2).rack_bytes == pytest.approx(4 * 2 * 1 / 2 * 200 * 4)
    assert _one(node_settings(model=model, cluster=cluster), 2).rack_bytes is None


@pytest.mark.parametrize("kwargs,pattern", [
    (dict(cluster=ClusterSpec(node_sizes=(8, 4), gpu_memory_bytes=H100)), r"^expected nodes of one size.*\[4, 8\]"),
    (dict(cluster=ClusterSpec(node_sizes=(8,) * 4, gpu_memory_bytes=H100), rack_sizes=(2, 1)),
     r"^expected rack sizes summing to the 4 nodes, found \[2, 1\]"),
])
def test_refusals(kwargs, pattern):
    with pytest.raises(ValueError, match=pattern):
        node_settings(model=ModelSpec(**LLAMA_8B), **kwargs)


@pytest.mark.parametrize("headroom", [-0.1, 1.0, float("nan")])
def test_bad_headroom(headroom):
    cluster = ClusterSpec(node_sizes=(8,) * 2, gpu_memory_bytes=H100)
    with pytest.raises(ValueError, match="^expected a headroom fraction in"):
        recommend_nodes(node_settings(model=ModelSpec(**LLAMA_8B), cluster=cluster), cluster=cluster, headroom=headroom)


ARGS_405B = ["plan", "--model-params", "405e9", "--layers", "126", "--nodes", "32", "--gpus-per-node", "8", "--multi-node"]


def test_cli_multi_node_table_and_json(capsys):
    assert main(ARGS_405B + ["--reduce-dtype", "bf16", "--racks", "4"]) == 0
    out = capsys.readouterr().out
    assert "recommended: k=8 +optim: the smallest k that fits in 72.0 GB" in out
    assert "k=16" not in out  # 8 nodes a rack: groups of 16 nodes would cross racks
    assert main(ARGS_405B + ["--headroom", "0.02", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["recommended"] == {"nodes_per_shard_group": 32, "label": "k=32"}
    assert [r["nodes_per_shard_group"] for r in data["settings"]][-1] == 32
    assert main(ARGS_405B + ["--headroom", "2"]) == 2
    assert "expected a headroom fraction" in capsys.readouterr().err
