"""Shard groups of k whole nodes: the plan (tiling, racks, refusals), the two-hop groups over nodes,
and, on 4 ranks in 2 simulated nodes (k = 2), the groups built, parity with one process, and
checkpoints resharded between k = 2 and k = 1."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from hybridshard.topology.planner import GroupPlan, format_plan, plan_groups
from hybridshard.topology.shard_hops import plan_shard_hops
from hybridshard.topology.synthetic import rank_order, synthetic_cluster
from tests import runtime_models as RM
from tests.mp import RankPool


def _check_grid(plan: GroupPlan) -> None:
    everyone = sorted(r for g in plan.shard_groups for r in g)
    assert everyone == list(range(plan.world_size))
    assert sorted(r for g in plan.replicate_groups for r in g) == everyone
    assert plan.shard_size * plan.replicate_size == plan.world_size
    for rank in range(plan.world_size):
        r, s = plan.coords(rank)
        assert plan.mesh()[r][s] == rank


# -- the plan -------------------------------------------------------------------------------------


def test_two_nodes_per_group_are_node_major():
    plan = plan_groups(synthetic_cluster(4, 2), shard_size=4)
    _check_grid(plan)
    assert plan.shard_nodes == 2 and plan.ranks_per_node == 2
    assert plan.shard_groups == ((0, 1, 2, 3), (4, 5, 6, 7))
    assert plan.replicate_groups == ((0, 4), (1, 5), (2, 6), (3, 7))
    assert plan.shard_group_hosts == (("node0", "node1"), ("node2", "node3"))
    assert plan.shard_group_domains == ("node0+node1", "node2+node3")
    assert plan.row_racks == ()
    assert "2 nodes x 2 ranks per shard group" in format_plan(plan)


def test_cyclic_launch_keeps_node_major_members_and_like_positions_in_replicate_groups():
    cluster = synthetic_cluster(4, 2, layout="cyclic")  # node n holds ranks n and n + 4
    plan = plan_groups(cluster, shard_size=4)
    _check_grid(plan)
    assert plan.shard_groups == ((0, 4, 1, 5), (2, 6, 3, 7))
    for column, group in enumerate(plan.replicate_groups):
        # member (j, p) of every shard group: the same local position p on every node
        locals_ = {e.local_rank for n in cluster.nodes for e in n.ranks if e.rank in group}
        assert locals_ == {column % 2}, (column, group)


def test_groups_stay_inside_racks_in_network_order():
    # racks dealt round-robin: node0, node2 in rack0; node1, node3 in rack1
    paths = [("pod0", f"rack{i % 2}") for i in range(4)]
    plan = plan_groups(synthetic_cluster(4, 2, network_paths=paths), shard_size=4)
    _check_grid(plan)
    assert plan.shard_group_hosts == (("node0", "node2"), ("node1", "node3"))
    assert plan.shard_groups == ((0, 1, 4, 5), (2, 3, 6, 7))
    assert plan.row_racks == ("pod0/rack0", "pod0/rack1")


def test_whole_job_as_one_shard_group_and_32_nodes_in_4_racks():
    plan = plan_groups(synthetic_cluster(2, 4), shard_size=8)
    assert plan.replicate_size == 1 and plan.shard_groups == (tuple(range(8)),)
    big = plan_groups(synthetic_cluster(32, 8, racks=4), shard_size=32)
    _check_grid(big)
    assert (big.shard_nodes, big.replicate_size) == (4, 8)
    for q, hosts in enumerate(big.shard_group_hosts):
        assert hosts == tuple(f"node{4 * q + j}" for j in range(4))
        assert big.row_racks[q] == f"pod0/rack{q // 2}"


def test_existing_plans_are_unchanged_at_or_below_the_node_size():
    for size in (None, 1, 2, 4):
        plan = plan_groups(synthetic_cluster(2, 4), shard_size=size)
        assert plan.shard_nodes == 1 and plan.shard_group_hosts == ()
        assert all(len({r // 4 for r in g}) == 1 for g in plan.shard_groups)


def test_plan_round_trips_through_dict():
    plan = plan_groups(synthetic_cluster(4, 2, racks=2), shard_size=4)
    assert GroupPlan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("cluster,size,pattern", [
    (synthetic_cluster(3, 4), 8, r"^shard_size=8 .*expects a node count divisible by 2, found 3 nodes .*shard_size in \[12\]"),
    (synthetic_cluster(4, 4), 6, r"^shard_size=6 does not tile the nodes: .*expects a multiple of the 4 ranks per node.*shard_size=4 or 8"),
    (synthetic_cluster(2, [8, 4]), 16, r"^shard_size=16 spans nodes and expects nodes of one size.*node0: 8, node1: 4"),
    (synthetic_cluster(6, 2, racks=2), 4,
     r"^shard_size=4 expects 2 whole nodes of one rack.*pod0/rack0: 3 nodes, pod0/rack1: 3 nodes.*shard_size in \[6\]"),
])
def test_refusals_name_the_counts_and_the_fix(cluster, size, pattern):
    with pytest.raises(ValueError, match=pattern):
        plan_groups(cluster, shard_size=size)


def test_uneven_racks_are_refused_naming_only_the_bad_rack():
    paths = [("pod0", "rack0")] * 4 + [("pod0", "rack1")] * 3 + [("pod0", "rack2")]
    with pytest.raises(ValueError, match=r"\(pod0/rack1: 3 nodes, pod0/rack2: 1 nodes\); pass a shard_size that divides 2") as err:
        plan_groups(synthetic_cluster(8, 2, network_paths=paths), shard_size=4)
    assert "rack0" not in str(err.value)


# -- the two-hop groups over nodes ----------------------------------------------------------------


def test_shard_hops_follow_the_members_order():
    plan = plan_groups(synthetic_cluster(4, 2, layout="cyclic"), shard_size=4)
    hops, why = plan_shard_hops(plan)
    assert why == "" and (hops.nodes, hops.per_node) == (2, 2)
    assert hops.node_groups == ((0, 4), (1, 5), (2, 6), (3, 7))  # q * k + j
    assert hops.across_groups == ((0, 1), (4, 5), (2, 3), (6, 7))  # q * g + p
    assert hops.node_names == ("node0", "node1", "node2", "node3")
    for rank in range(plan.world_size):
        racks = hops.groups_of(rank, "node-pg", "across-pg")
        q, s = plan.coords(rank)
        assert racks.replicate_rank == s, rank  # j * g + p is the shard rank
        assert (racks.racks, racks.per_rack, racks.rack, racks.across) == (2, 2, "node-pg", "across-pg")
        assert racks.rack_name == plan.shard_group_hosts[q][racks.rack_index]
        assert hops.node_groups[q * 2 + racks.rack_index][racks.position] == rank
        assert hops.across_groups[q * 2 + racks.position][racks.rack_index] == rank


def test_shard_hops_of_8_nodes_of_8():
    plan = plan_groups(synthetic_cluster(8, 8), shard_size=32)
    hops, _ = plan_shard_hops(plan)
    assert len(hops.node_groups) == 8 and len(hops.across_groups) == 16
    assert hops.across_groups[3] == (3, 11, 19, 27) and hops.node_groups[5] == tuple(range(40, 48))


@pytest.mark.parametrize("cluster,size,why", [
    (synthetic_cluster(2, 4), 4, "inside one node"),
    (synthetic_cluster(4, 1), 2, "one rank per node"),
])
def test_no_shard_hops_says_why(cluster, size, why):
    hops, reason = plan_shard_hops(plan_groups(cluster, shard_size=size))
    assert hops is None and why in reason


def test_a_rank_outside_the_plan_is_refused():
    hops, _ = plan_shard_hops(plan_groups(synthetic_cluster(2, 2), shard_size=4))
    with pytest.raises(ValueError, match="^expected rank 9 in a shard group"):
        hops.place(9)


def test_rank_order_helper_is_the_one_the_planner_reads():
    assert rank_order(2, 2, "cyclic") == [(0, 0), (1, 0), (0, 1), (1, 1)]


# -- 4 ranks on 2 simulated nodes: one shard group over both (k = 2) ------------------------------

WORLD = 4
SGD = dict(optimizer="sgd", clip=1e6)  # a clip that never binds: a constant-factor error shows
SWEEP = [RM.Config(strategy=s, **SGD) for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")]
SWEEP += [RM.Config(strategy="HYBRID_SHARD", checkpoint=True, micro_steps=2, clip=1.0),
          RM.Config(strategy="HYBRID_SHARD", executor="emulate", **SGD)]
_BUILT: dict = {}


def _groups(shard_size: int | None, *, flat: bool = False):
    """``init_groups(shard_size=...)`` once per process and size; ``flat``: without the two hops over
    nodes, so hybrid units run the flat collectives over the whole multi-node shard group."""
    import hybridshard as hs

    if shard_size not in _BUILT:
        _BUILT[shard_size] = hs.init_groups(shard_size=shard_size)
    return dataclasses.replace(_BUILT[shard_size], shard_hops=None) if flat else _BUILT[shard_size]


def _groups_job() -> dict:
    import torch.distributed as dist

    from hybridshard.topology.groups import group_name, group_ranks

    groups = _groups(4)
    hops = groups.shard_hops
    members = [None] * groups.shard_size
    dist.all_gather_object(members, dist.get_rank(), group=groups.shard)
    return {"sizes": (groups.shard_size, groups.replicate_size, groups.shard_rank), "members": members,
            "planned": list(groups.plan.shard_group_of(dist.get_rank())), "shard_nodes": groups.plan.shard_nodes,
            "hops": (hops.racks, hops.per_rack, hops.rack_index, hops.position, hops.rack_name, hops.replicate_rank),
            "node": group_ranks(hops.rack), "across": group_ranks(hops.across),
            "names": (group_name(hops.rack), group_name(hops.across)),
            "mesh": None if groups.mesh is None else (groups.mesh.mesh_dim_names, groups.mesh.mesh.tolist()),
            "one_node_hops": _groups(None).shard_hops}


def _hops_collectives_job(n: int) -> dict:
    """The shard group's two-hop gather and reduce-scatter against the flat collectives over it."""
    import torch.distributed as dist

    from hybridshard.runtime.comm import collectives as C
    from hybridshard.runtime.comm import two_hop

    groups = _groups(4)
    gen = torch.Generator().manual_seed(dist.get_rank())
    mine = torch.randn(n, generator=gen)
    flat, two = torch.empty(4 * n), torch.empty(4 * n)
    C.all_gather(flat, mine, groups.shard)
    two_hop.gather(two, mine, two_hop.ShardHops(groups.shard_hops))
    full = torch.randn(4 * n, generator=gen)
    flat_rs, two_rs = torch.empty(n), torch.empty(n)
    C.reduce_scatter(flat_rs, full.clone(), groups.shard)
    two_hop.shard_reduce_scatter(two_rs, full.clone(), groups.shard_hops)
    return {"gather": (flat, two), "reduce_scatter": (flat_rs, two_rs)}


def _sweep_job(configs: list) -> list[dict]:
    RM._GROUPS["groups"] = _groups(4, flat=True)
    try:
        return RM.run_configs(configs)
    finally:
        RM._GROUPS.clear()


def _train(model, opt, steps: range, micro: int = 2) -> list[float]:
    import torch.distributed as dist

    losses = []
    for step in steps:
        opt.zero_grad(set_to_none=True)
        tokens = RM.batch(step, 0, dist.get_rank(), micro)
        loss = RM.lm_loss(model(tokens), tokens)
        loss.backward()
        opt.step()
        out = loss.detach().reshape(1)
        dist.all_reduce(out)
        losses.append(out.item() / dist.get_world_size())
    return losses


def _stage(shard_size: int | None, seed: int, *, load: str | None, save: str, train_steps: int = 0) -> dict:
    """Build on ``shard_size``'s groups, (train | load), record, save, take one more step."""
    import hybridshard as hs

    model = RM.make_model(seed)
    hs.shard(model, strategy="HYBRID_SHARD", groups=_groups(shard_size), wrap={RM.Block})  # k=2: two hops
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.05)
    _train(model, opt, range(train_steps))
    if load:
        hs.checkpoint.load(load, model, optimizer=opt)
    state, optim = hs.checkpoint.full_state_dict(model), hs.checkpoint.full_optim_state_dict(model, opt)
    hs.checkpoint.save(save, model, optimizer=opt)
    loss = _train(model, opt, range(7, 8))[0]
    return {"state": state, "optim": optim, "loss": loss, "after": hs.checkpoint.full_state_dict(model),
            "shard_size": _groups(shard_size).shard_size}


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=2, layout="block") as p:
        yield p


@pytest.mark.multiprocess
def test_groups_over_two_nodes(pool):
    for rank, got in enumerate(pool.run(_groups_job)):
        j, p = divmod(rank, 2)
        assert got["sizes"] == (4, 1, rank) and got["shard_nodes"] == 2, got
        assert got["members"] == got["planned"] == [0, 1, 2, 3]
        assert got["hops"] == (2, 2, j, p, f"node{j}", rank), got
        assert got["node"] == [2 * j, 2 * j + 1] and got["across"] == [p, p + 2], got
        assert got["names"] == ("shard_node", "shard_across")
        assert got["mesh"] in (None, (("replicate", "shard"), [[0, 1, 2, 3]])), got["mesh"]
        assert got["one_node_hops"] is None


@pytest.mark.multiprocess
def test_shard_hops_run_the_two_hop_functions_exactly(pool):
    """Node-major members make the two-hop all-gather and reduce-scatter (rack_groups' layout, k nodes as
    racks) give what the flat collectives over the 4-rank shard group give."""
    for rank, got in enumerate(pool.run(_hops_collectives_job, 5)):
        flat, two = got["gather"]
        assert torch.equal(flat, two), (rank, flat, two)
        flat, two = got["reduce_scatter"]
        torch.testing.assert_close(two, flat, atol=1e-6, rtol=1e-6, msg=lambda m: f"rank {rank}: {m}")


@pytest.fixture(scope="module")
def sweep(pool):
    return pool.run(_sweep_job, SWEEP)


@pytest.mark.multiprocess
@pytest.mark.parametrize("index", range(len(SWEEP)))
def test_flat_k2_shard_group_matches_one_process(sweep, index):
    """Losses, norms and parameters of the 4-rank shard group over 2 nodes, run with the flat
    collectives (``shard_hops`` dropped), equal one process."""
    RM.check_ranks(SWEEP[index], sweep, index, WORLD, counts=False)
    for rank in range(WORLD):
        assert ("all_gather", "shard") in sweep[rank][index]["counts"][-1], sweep[rank][index]["counts"][-1]


def _same(got: dict, ref: dict, label: str) -> None:
    assert set(got) == set(ref), label
    for key, value in ref.items():
        if isinstance(value, dict):
            _same(got[key], value, f"{label}.{key}")
        elif isinstance(value, torch.Tensor):
            assert torch.equal(got[key], value), f"{label}.{key}"
        else:
            assert got[key] == value, f"{label}.{key}"


@pytest.mark.multiprocess
def test_checkpoint_of_k2_loads_into_k1_and_back(pool, tmp_path):
    """k = 2 (one shard group of 4 over both nodes) -> k = 1 (shard size 2, 2 replicas) -> k = 2: the
    loaded parameters and optimizer state are the saved ones exactly, and the next step agrees."""
    paths = [str(tmp_path / f"ckpt{i}") for i in range(3)]
    first = pool.run(_stage, 4, 1, load=None, save=paths[0], train_steps=3)
    down = pool.run(_stage, None, 2, load=paths[0], save=paths[1])
    up = pool.run(_stage, 4, 3, load=paths[1], save=paths[2])
    assert [r["shard_size"] for r in first + down + up] == [4] * WORLD + [2] * WORLD + [4] * WORLD
    for rank in range(WORLD):
        for label, got in (("k=1", down[rank]), ("k=2 again", up[rank])):
            _same(got["state"], first[0]["state"], f"rank {rank} {label} state")
            _same(got["optim"], first[0]["optim"], f"rank {rank} {label} optimizer")
            assert got["loss"] == pytest.approx(first[0]["loss"], rel=1e-6, abs=1e-6), (rank, label)
            for key, value in first[0]["after"].items():
                torch.testing.assert_close(got["after"][key], value, atol=1e-5, rtol=1e-5)


@pytest.mark.multiprocess
def test_groups_over_two_nodes_in_a_cyclic_launch():
    """node0 holds ranks 0, 2 and node1 ranks 1, 3: the shard group's rank order is the plan's node-major
    order (0, 2, 1, 3), not the global order, and each rank's two-hop place is its shard rank."""
    with RankPool(WORLD, num_nodes=2, layout="cyclic") as cyclic:
        got = cyclic.run(_groups_job)
    order = [0, 2, 1, 3]
    for rank, info in enumerate(got):
        j, p = divmod(order.index(rank), 2)
        assert info["members"] == info["planned"] == order, info
        assert info["sizes"] == (4, 1, order.index(rank))
        assert info["hops"] == (2, 2, j, p, f"node{j}", order.index(rank)), info
        assert info["node"] == order[2 * j:2 * j + 2] and info["across"] == [order[p], order[p + 2]], info
