"""The replicate reduction in two hops across racks (``CommConfig(rack_reduce=...)``): the groups in
network order, parity with one process and with the flat reduction, compression, checkpoints.

4 hosts x 1 rank in 2 racks: the replicate group has R = 4 members, r = 2 in each of P = 2 racks.
Racks are given to the cluster view as each node's network path, in two assignments: ``block``
(node0 and node1 in rack 0: network order is global-rank order) and ``cyclic`` (node0 and node2 in
rack 0: a launch whose global ranks interleave racks, so the groups must be created in network order).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
RACKS = {
    "block": {"node0": ("pod0", "rack0"), "node1": ("pod0", "rack0"), "node2": ("pod0", "rack1"), "node3": ("pod0", "rack1")},
    "cyclic": {"node0": ("pod0", "rack0"), "node1": ("pod0", "rack1"), "node2": ("pod0", "rack0"), "node3": ("pod0", "rack1")},
}
SGD = dict(optimizer="sgd", clip=1e6)  # a clip that never binds: a constant-factor error shows
SWEEP = [
    RM.Config(strategy=s, shard_optimizer=o, rack_reduce=two, **SGD)
    for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") for o in (False, True) for two in (True, False)
]
SWEEP += [RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, executor=e, micro_steps=2, **SGD)
          for e in ("streams", "emulate")]
SWEEP += [RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, shard_optimizer=True, executor="emulate", **SGD),
          RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, overlap_grads=False, prefetch=0, clip=1.0),
          RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, micro_steps=3, reduce_scatter_micro=True, **SGD)]
COMPRESSED = [RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, compression="int8", **SGD),
              RM.Config(strategy="HYBRID_SHARD", rack_reduce=True, compression="int8", shard_optimizer=True, **SGD)]


def _label(c: RM.Config) -> str:
    return (f"{c.strategy}-{'two' if c.rack_reduce else 'flat'}" + ("-optim" if c.shard_optimizer else "")
            + (f"-{c.executor}" if c.executor else "") + (f"-micro{c.micro_steps}" if c.micro_steps > 1 else "")
            + ("-rs" if c.reduce_scatter_micro else "") + ("-sync" if not c.overlap_grads else ""))


def racked_groups(paths: dict[str, tuple[str, ...]]):
    """``init_groups()`` with each node's network path taken from ``paths`` (node name -> path)."""
    import torch.distributed as dist

    from hybridshard.topology.cluster import gather_cluster
    from hybridshard.topology.groups import build_groups
    from hybridshard.topology.planner import plan_groups
    from hybridshard.topology.probe import probe_rank

    cluster = gather_cluster(probe_rank(rank=dist.get_rank(), world_size=dist.get_world_size()))
    nodes = tuple(dataclasses.replace(n, probe=dataclasses.replace(n.probe, network_path=paths[n.name]))
                  for n in cluster.nodes)
    cluster = dataclasses.replace(cluster, nodes=nodes)
    return build_groups(plan_groups(cluster), cluster=cluster)


def _order_job(assignment: str) -> dict:
    import torch.distributed as dist

    groups = racked_groups(RACKS[assignment])
    members = [None] * groups.replicate_size
    dist.all_gather_object(members, dist.get_rank(), group=groups.replicate)
    racks = groups.racks
    return {"members": members, "planned": list(groups.plan.replicate_group_of(dist.get_rank())),
            "replicate_rank": groups.replicate_rank,
            "racks": (racks.racks, racks.per_rack, racks.rack_index, racks.position, racks.rack_name)}


def _sweep_job(assignment: str, configs: list[RM.Config]) -> list[dict]:
    RM._GROUPS["groups"] = racked_groups(RACKS[assignment])
    try:
        return RM.run_configs(configs)
    finally:
        RM._GROUPS.clear()


@pytest.fixture(scope="module")
def pool():
    with RankPool(WORLD, num_nodes=WORLD, layout="block") as p:
        yield p


@pytest.mark.parametrize("assignment", sorted(RACKS))
def test_replicate_group_rank_follows_network_order(pool, assignment):
    """The replicate group's rank i is the plan's i-th member, racks first, whatever the global order."""
    got = pool.run(_order_job, assignment)
    rack0 = sorted(n for n, p in RACKS[assignment].items() if p[-1] == "rack0")
    expected = [int(n[4:]) for n in rack0] + [int(n[4:]) for n in sorted(set(RACKS[assignment]) - set(rack0))]
    for rank, info in enumerate(got):
        assert info["planned"] == expected, info
        assert info["members"] == expected, f"rank {rank}: group ranks {info['members']}, network order {expected}"
        assert info["replicate_rank"] == expected.index(rank)
        k, p = divmod(expected.index(rank), 2)
        assert info["racks"] == (2, 2, k, p, f"pod0/rack{k}"), info


@pytest.fixture(scope="module")
def sweeps(pool):
    return {a: pool.run(_sweep_job, a, SWEEP + COMPRESSED) for a in sorted(RACKS)}


@pytest.mark.parametrize("assignment", sorted(RACKS))
@pytest.mark.parametrize("index", range(len(SWEEP)), ids=[_label(c) for c in SWEEP])
def test_parity_with_one_process(sweeps, assignment, index):
    """Losses, gradient norms and parameters equal one process on the global batch."""
    RM.check_ranks(SWEEP[index], sweeps[assignment], index, WORLD, counts=False)


@pytest.mark.parametrize("assignment", sorted(RACKS))
def test_two_hops_equal_the_flat_reduction(sweeps, assignment):
    """The same results as the flat reduction to 1e-6 in fp32, and the two-hop collectives on the rack groups."""
    results = sweeps[assignment]
    pairs = [(i, SWEEP.index(dataclasses.replace(c, rack_reduce=False))) for i, c in enumerate(SWEEP)
             if c.rack_reduce and dataclasses.replace(c, rack_reduce=False) in SWEEP]
    assert len(pairs) == 4
    for two, flat in pairs:
        for rank in range(WORLD):
            RM.compare(results[rank][flat], results[rank][two], atol=1e-6, rtol=1e-6, label=f"{_label(SWEEP[two])} rank {rank}")
            counts = results[rank][two]["counts"][-1]
            flat_counts = results[rank][flat]["counts"][-1]
            assert not any(group == "replicate" for _, group in counts), counts
            if SWEEP[two].shard_optimizer:
                assert counts[("reduce_scatter", "rack")] == counts[("reduce_scatter", "across_racks")] \
                    == flat_counts[("reduce_scatter", "replicate")], counts
            else:
                assert counts[("reduce_scatter", "rack")] == counts[("all_reduce", "across_racks")] \
                    == counts[("all_gather", "rack")] == flat_counts[("all_reduce", "replicate")], counts


@pytest.mark.parametrize("index", range(len(COMPRESSED)))
def test_int8_across_racks_is_close_and_every_replica_agrees(sweeps, index):
    """int8 on the hop across racks (error feedback kept): close to one process, the same on every replica."""
    results = sweeps["cyclic"]
    at = len(SWEEP) + index
    ref = RM.reference_run(COMPRESSED[index], WORLD)
    for rank in range(WORLD):
        RM.compare(ref, results[rank][at], atol=3e-2, rtol=3e-2, label=f"rank {rank}")
        counts = results[rank][at]["counts"][-1]
        assert ("all_to_all", "across_racks") in counts and ("all_to_all", "replicate") not in counts, counts
    for key, value in results[0][at]["state"].items():
        for rank in range(1, WORLD):
            assert torch.equal(results[rank][at]["state"][key], value), (key, rank)


def _checkpoint_job(path: str) -> dict:
    import torch.distributed as dist

    import hybridshard as hs

    cfg = RM.Config(strategy="HYBRID_SHARD", shard_optimizer=True, rack_reduce=True, steps=2, **SGD)
    RM._GROUPS["groups"] = racked_groups(RACKS["cyclic"])
    try:
        model = RM.make_model()
        hs.shard(model, strategy=cfg.strategy, groups=RM.groups(), rack_reduce=True, shard_optimizer_across_replicas=True)
        opt = RM.make_optimizer(cfg, model.parameters())
        for step in range(2):
            opt.zero_grad()
            tokens = RM.batch(step, 0, dist.get_rank(), cfg.micro_batch)
            RM.lm_loss(model(tokens), tokens).backward()
            opt.step()
        saved = hs.full_state_dict(model)
        hs.checkpoint.save(path, model, optimizer=opt)
    finally:
        RM._GROUPS.clear()
    flat = RM.make_model()
    hs.shard(flat, strategy="HYBRID_SHARD", groups=hs.init_groups())  # one rack: no network paths
    flat_opt = RM.make_optimizer(cfg, flat.parameters())
    hs.checkpoint.load(path, flat, optimizer=flat_opt)
    loaded = hs.full_state_dict(flat)
    return {"equal": sorted(k for k in saved if torch.equal(saved[k], loaded[k])), "keys": sorted(saved)}


def test_a_two_rack_checkpoint_loads_into_one_rack(pool, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("racks") / "step_2")
    for rank, got in enumerate(pool.run(_checkpoint_job, path)):
        assert got["equal"] == got["keys"], f"rank {rank}: differ: {sorted(set(got['keys']) - set(got['equal']))}"


@pytest.mark.parametrize("assignment", sorted(RACKS))
def test_two_hops_make_no_host_sync_on_the_emulated_device(sweeps, assignment):
    """Under ``executor="emulate"`` the two hops' waits are stream waits: no hot-path host sync."""
    emulated = [i for i, c in enumerate(SWEEP) if c.executor == "emulate"]
    assert len(emulated) == 2
    for i in emulated:
        for rank in range(WORLD):
            syncs = sweeps[assignment][rank][i]["host_syncs"]
            assert syncs is not None and syncs["hot"] == {}, f"{_label(SWEEP[i])} rank {rank}: {syncs}"


def _auto_job(rates: str | None) -> bool:
    import os

    import hybridshard as hs

    RM._GROUPS["groups"] = racked_groups(RACKS["cyclic"])
    if rates is None:
        os.environ.pop("HYBRIDSHARD_LINK_RATES", None)
    else:
        os.environ["HYBRIDSHARD_LINK_RATES"] = rates
    try:
        model = RM.make_model()
        hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups())  # rack_reduce=None: the cost model
        return model.hybridshard_runtime.rack_reduce
    finally:
        os.environ.pop("HYBRIDSHARD_LINK_RATES", None)
        RM._GROUPS.clear()


@pytest.mark.parametrize("rates, expected", [("node=10gbit,spine=2.5gbit", True), ("node=10gbit,spine=40gbit", False),
                                             (None, None)])
def test_rack_reduce_none_asks_the_cost_model(pool, rates, expected):
    """A spine at 1/4 of the hosts' links picks two hops, a fast one the flat ring; measured rates give
    one answer on every rank."""
    got = pool.run(_auto_job, rates)
    assert len(set(got)) == 1, got
    if expected is not None:
        assert got[0] is expected, (rates, got)


def _true_without_racks() -> str:
    import hybridshard as hs

    try:
        hs.shard(RM.make_model(), strategy="HYBRID_SHARD", groups=hs.init_groups(), rack_reduce=True)
    except ValueError as err:
        return str(err).splitlines()[0]
    return "no error"


def test_rack_reduce_true_without_racks_names_why(pool):
    first = pool.run(_true_without_racks)[0]
    assert first.startswith("CommConfig(rack_reduce=True) expects replicate groups that span racks"), first
    assert "the replicate groups lie in one rack" in first and "HYBRIDSHARD_NETWORK_PATH" in first, first
