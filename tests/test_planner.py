"""Planner: a pure function from a cluster view to shard and replicate groups."""

from __future__ import annotations

import dataclasses

import pytest

from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.planner import GroupPlan, find_domains, plan_groups
from hybridshard.topology.records import ClusterView, RankProbe
from hybridshard.topology.synthetic import rank_order, synthetic_cluster, synthetic_node


def _same_node_groups(cluster: ClusterView) -> set[tuple[int, ...]]:
    return {n.global_ranks for n in cluster.nodes}


def _check_grid(plan: GroupPlan) -> None:
    """Invariants every plan satisfies, whatever the layout."""
    everyone = sorted(r for g in plan.shard_groups for r in g)
    assert everyone == list(range(plan.world_size))
    assert sorted(r for g in plan.replicate_groups for r in g) == everyone
    assert all(len(g) == plan.shard_size for g in plan.shard_groups)
    assert all(len(g) == plan.replicate_size for g in plan.replicate_groups)
    assert plan.shard_size * plan.replicate_size == plan.world_size
    for rank in range(plan.world_size):
        r, s = plan.coords(rank)
        assert plan.mesh()[r][s] == rank
        assert set(plan.shard_group_of(rank)) & set(plan.replicate_group_of(rank)) == {rank}


@pytest.mark.parametrize("num_nodes,gpus", [(1, 8), (2, 2), (4, 8), (3, 4)])
def test_block_grid(num_nodes, gpus):
    cluster = synthetic_cluster(num_nodes, gpus)
    plan = plan_groups(cluster)
    _check_grid(plan)
    assert plan.shard_size == gpus and plan.replicate_size == num_nodes
    assert plan.shard_groups == tuple(tuple(range(n * gpus, (n + 1) * gpus)) for n in range(num_nodes))
    assert plan.replicate_groups[0] == tuple(n * gpus for n in range(num_nodes))


def test_cyclic_layout_groups_by_node_not_rank_arithmetic():
    cluster = synthetic_cluster(2, 4, layout="cyclic")
    plan = plan_groups(cluster)
    _check_grid(plan)
    # node0 holds ranks 0, 2, 4, 6: they shard together even though rank // 4 says otherwise.
    assert plan.shard_groups == ((0, 2, 4, 6), (1, 3, 5, 7))
    assert plan.replicate_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert set(plan.shard_groups) == _same_node_groups(cluster)


def test_any_rank_order_gives_same_node_groups_in_local_rank_order():
    order = rank_order(3, 4, "block")
    shuffled = [order[i] for i in (7, 2, 11, 0, 5, 9, 1, 3, 10, 6, 4, 8)]
    cluster = synthetic_cluster(3, 4, order=shuffled)
    plan = plan_groups(cluster)
    _check_grid(plan)
    assert set(plan.shard_groups) == _same_node_groups(cluster)
    for group in plan.shard_groups:
        node = cluster.node_of(group[0])
        local = {e.rank: e.local_rank for e in node.ranks}
        assert [local[r] for r in group] == [0, 1, 2, 3]
    # Replicate group i pairs the same local rank on every node.
    for s, rgroup in enumerate(plan.replicate_groups):
        assert {cluster.node_of(r).ranks[s].rank for r in rgroup} == set(rgroup)


def test_plan_is_independent_of_probe_order():
    cluster = synthetic_cluster(2, 4, layout="cyclic")
    probes = [
        RankProbe(rank=e.rank, local_rank=e.local_rank, world_size=8, node=n.probe, gpu_uuid=e.gpu_uuid)
        for n in cluster.nodes
        for e in n.ranks
    ]
    assert plan_groups(assemble_cluster(probes)) == plan_groups(assemble_cluster(probes[::-1]))


def test_heterogeneous_nodes_take_largest_tiling_size():
    cluster = synthetic_cluster(3, [8, 4, 8])
    plan = plan_groups(cluster)
    _check_grid(plan)
    assert plan.shard_size == 4 and plan.replicate_size == 5
    assert plan.shard_group_domains == ("node0#0", "node0#1", "node1", "node2#0", "node2#1")
    assert any("below the largest domain" in n for n in plan.notes)


def test_heterogeneous_nodes_with_no_tiling_size_name_hosts_and_counts():
    cluster = synthetic_cluster(2, [3, 2])
    with pytest.raises(ValueError, match=r"node0: 3, node1: 2.*shard_size=1"):
        plan_groups(cluster)


@pytest.mark.parametrize("bad", [3, 0, -2, 2.0, True])
def test_bad_shard_size(bad):
    cluster = synthetic_cluster(2, 4)
    with pytest.raises(ValueError, match="shard_size"):
        plan_groups(cluster, shard_size=bad)


def test_bad_shard_size_error_names_domains_and_choices():
    with pytest.raises(ValueError, match=r"node0: 4, node1: 4.*\[1, 2, 4\]"):
        plan_groups(synthetic_cluster(2, 4), shard_size=3)


def test_explicit_smaller_shard_size_splits_each_node():
    plan = plan_groups(synthetic_cluster(2, 4), shard_size=2)
    _check_grid(plan)
    assert plan.shard_groups == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.replicate_groups == ((0, 2, 4, 6), (1, 3, 5, 7))


def test_shard_size_one_still_replicates_across_every_rank():
    plan = plan_groups(synthetic_cluster(2, 4), shard_size=1)
    _check_grid(plan)
    assert plan.replicate_groups == (tuple(range(8)),)
    assert any("still all-reduced" in n for n in plan.notes)
    # One rank per node: shard size 1 is chosen without being asked, and still replicates.
    plan = plan_groups(synthetic_cluster(3, 1))
    assert plan.shard_size == 1 and plan.replicate_groups == ((0, 1, 2),)


def test_nvlink_islands_of_pairs():
    cluster = synthetic_cluster(2, 8, nvlink="pairs")
    domains = find_domains(cluster, "nvlink")
    assert [d.ranks for d in domains][:4] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    plan = plan_groups(cluster, domain="nvlink")
    _check_grid(plan)
    assert plan.shard_size == 2 and plan.replicate_size == 8
    assert plan.shard_group_domains[:2] == ("node0/nvlink0", "node0/nvlink2")
    with pytest.raises(ValueError, match="nvlink"):
        plan_groups(cluster, domain="nvlink", shard_size=4)


def test_nvswitch_node_is_one_nvlink_domain():
    plan = plan_groups(synthetic_cluster(2, 8, nvlink="nvswitch"), domain="nvlink")
    assert plan.shard_groups == (tuple(range(8)), tuple(range(8, 16)))


def test_fabric_clique_spans_nodes():
    # Four 4-GPU nodes of a multi-node NVLink rack, two nodes per clique.
    cluster = synthetic_cluster(4, 4, nvlink="none", fabric_nodes_per_clique=2)
    plan = plan_groups(cluster, domain="nvlink")
    _check_grid(plan)
    assert plan.shard_size == 8
    assert plan.shard_groups == (tuple(range(8)), tuple(range(8, 16)))
    assert plan.shard_group_domains == ("fabric:fabric-0000-synthetic/0", "fabric:fabric-0000-synthetic/1")
    # The node domain ignores the fabric.
    assert plan_groups(cluster).shard_size == 4


def test_fabric_clique_in_cyclic_order_keeps_node_then_local_order():
    cluster = synthetic_cluster(2, 2, layout="cyclic", nvlink="none", fabric_nodes_per_clique=2)
    plan = plan_groups(cluster, domain="nvlink")
    # node0 has ranks 0, 2 and node1 has 1, 3: the clique lists node0's ranks first.
    assert plan.shard_groups == ((0, 2, 1, 3),)


def test_numa_domains():
    plan = plan_groups(synthetic_cluster(2, 8, numa_per_node=2), domain="numa")
    _check_grid(plan)
    assert plan.shard_groups[:2] == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert plan.shard_group_domains[:2] == ("node0/numa0", "node0/numa1")


def test_nvlink_domain_without_gpus_is_a_clear_error():
    node = dataclasses.replace(synthetic_node("cpu0", gpus_per_node=1), gpus=(), gpu_matrix=())
    probes = [RankProbe(rank=r, local_rank=r, world_size=2, node=node) for r in range(2)]
    cluster = assemble_cluster(probes)
    with pytest.raises(ValueError, match=r"rank 0 on host 'cpu0' has no GPU.*domain='node'"):
        plan_groups(cluster, domain="nvlink")
    with pytest.raises(ValueError, match="bind-numa"):
        plan_groups(cluster, domain="numa")
    assert plan_groups(cluster).shard_groups == ((0, 1),)


def test_unknown_domain():
    with pytest.raises(ValueError, match=r"domain must be one of \('node', 'nvlink', 'numa'\)"):
        plan_groups(synthetic_cluster(1, 2), domain="rack")


def test_plan_round_trips_through_dict():
    plan = plan_groups(synthetic_cluster(3, [8, 4, 8]))
    assert GroupPlan.from_dict(plan.to_dict()) == plan
    with pytest.raises(ValueError, match="rank 99"):
        plan.coords(99)


def test_assemble_rejects_missing_ranks():
    node = synthetic_node("a", gpus_per_node=2)
    probes = [RankProbe(rank=r, local_rank=r, world_size=3, node=node) for r in (0, 2)]
    with pytest.raises(ValueError, match=r"expected one probe for each rank 0..2"):
        assemble_cluster(probes)


def test_cluster_view_records_irregularities():
    cluster = synthetic_cluster(2, 2, layout="cyclic")
    assert not cluster.all_contiguous
    assert any("not one contiguous block" in n for n in cluster.notes)
    node = synthetic_node("a", gpus_per_node=1)
    shared = assemble_cluster(
        [RankProbe(rank=r, local_rank=r, world_size=2, node=node, gpu_uuid=node.gpus[0].uuid) for r in range(2)]
    )
    assert shared.shared_gpus == (("a", node.gpus[0].uuid, (0, 1)),)
    uneven = synthetic_cluster(2, [4, 2])
    assert not uneven.is_homogeneous and any("differ in size" in n for n in uneven.notes)
    assert ClusterView.from_dict(uneven.to_dict()) == uneven
