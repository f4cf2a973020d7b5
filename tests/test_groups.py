"""init_groups on 4 gloo ranks: as 2 nodes, in torchrun's block order and SLURM's cyclic order; and as
4 GPUs of one 8-GPU node replayed from an NVML fixture, for the ``nvlink`` and ``numa`` domains."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard.topology.nvml_recorded import FakeNvml
from tests.mp import RankPool

NVML_FIXTURES = Path(__file__).parent / "fixtures" / "nvml"

pytestmark = pytest.mark.multiprocess


def _members_reached(group: dist.ProcessGroup) -> list[int]:
    """All-reduce a one-hot of this rank over ``group``: the ranks whose bit arrives."""
    onehot = torch.zeros(dist.get_world_size())
    onehot[dist.get_rank()] = 1
    dist.all_reduce(onehot, group=group)
    return [int(r) for r in torch.nonzero(onehot).flatten()]


def check_init_groups(shard_size=None):
    groups = hs.init_groups(shard_size=shard_size)
    out = {
        "node": os.environ["HYBRIDSHARD_NODE_NAME"],
        "shard": dist.get_process_group_ranks(groups.shard),
        "replicate": dist.get_process_group_ranks(groups.replicate),
        "shard_reached": _members_reached(groups.shard),
        "replicate_reached": _members_reached(groups.replicate),
        "coords": (groups.replicate_rank, groups.shard_rank),
        "device": str(groups.device),
        "cluster_nodes": [n.name for n in groups.cluster.nodes],
    }
    if groups.mesh is not None:
        out["mesh_names"] = groups.mesh.mesh_dim_names
        out["mesh"] = groups.mesh.mesh.tolist()
        out["mesh_shard"] = dist.get_process_group_ranks(groups.mesh.get_group("shard"))
        out["mesh_replicate"] = dist.get_process_group_ranks(groups.mesh.get_group("replicate"))
    return out


def check_bad_shard_size():
    try:
        hs.init_groups(shard_size=3)
    except ValueError as err:
        return str(err)
    return None


@pytest.fixture(scope="module", params=["block", "cyclic"])
def pool(request):
    with RankPool(4, num_nodes=2, layout=request.param) as p:
        yield p


def test_groups_are_the_same_node_ranks(pool):
    results = pool.run(check_init_groups)
    by_node: dict[str, list[int]] = {}
    for rank, res in enumerate(results):
        by_node.setdefault(res["node"], []).append(rank)
    for rank, res in enumerate(results):
        same_node = by_node[res["node"]]
        assert res["shard"] == same_node
        assert res["shard_reached"] == same_node
        # Replicate: the rank at the same position on the other node.
        position = same_node.index(rank)
        expected = sorted(members[position] for members in by_node.values())
        assert sorted(res["replicate"]) == expected
        assert res["replicate_reached"] == expected
        assert res["coords"][1] == position
        assert res["device"] == "cpu"
        assert sorted(res["cluster_nodes"]) == ["node0", "node1"]
        assert res["mesh_names"] == ("replicate", "shard")
        assert res["mesh_shard"] == res["shard"]
        assert sorted(res["mesh_replicate"]) == expected
    # The grid is the same on every rank, rows = nodes.
    assert all(r["mesh"] == results[0]["mesh"] for r in results)
    assert sorted(map(sorted, results[0]["mesh"])) == sorted(by_node.values())


def test_shard_size_one_replicates_across_all(pool):
    results = pool.run(check_init_groups, shard_size=1)
    for rank, res in enumerate(results):
        assert res["shard"] == [rank] and res["shard_reached"] == [rank]
        assert res["replicate_reached"] == [0, 1, 2, 3]


def test_bad_shard_size_fails_fast_on_every_rank(pool):
    messages = pool.run(check_bad_shard_size, stall_s=30, max_s=30)  # fast: within 30 s even under load
    assert all(m is not None and "shard_size=3" in m and "node0: 2" in m for m in messages)


# -- nvlink and numa domains on a recorded 8-GPU node ----------------------------------------------
#
# The 4 ranks share one simulated node (LOCAL_RANK 0..3) whose GPUs are the fixture's 8. Each rank
# stands for the GPU that CUDA would give it: visible device LOCAL_RANK of CUDA_VISIBLE_DEVICES, as
# torchrun's one-GPU-per-local-rank convention has it. The visible list picks which 4 of the 8 GPUs:
#
# - pcie_nvlink_pairs, "0,1,2,3": NVLink bridges join 0-1 and 2-3; all four on NUMA node 0.
# - dgx_h100_nvswitch, "2,3,4,5": one NVSwitch domain; GPUs 2-3 on NUMA node 0, 4-5 on NUMA node 1.
# - pcie_nvlink_pairs, "0,4,1,5": ranks 0 and 2 hold the bridged pair 0-1 (NUMA 0), ranks 1 and 3 the
#   pair 4-5 (NUMA 1), so the groups are not runs of consecutive ranks.
#
# Expected groups are written out here, not taken from the planner: the test checks the planner too.

NVML_CASES = {
    # (fixture, CUDA_VISIBLE_DEVICES, domain): (shard groups, replicate groups)
    ("pcie_nvlink_pairs", "0,1,2,3", "nvlink"): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ("pcie_nvlink_pairs", "0,1,2,3", "numa"): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    ("dgx_h100_nvswitch", "2,3,4,5", "nvlink"): ([[0, 1, 2, 3]], [[0], [1], [2], [3]]),
    ("dgx_h100_nvswitch", "2,3,4,5", "numa"): ([[0, 1], [2, 3]], [[0, 2], [1, 3]]),
    ("pcie_nvlink_pairs", "0,4,1,5", "nvlink"): ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
    ("pcie_nvlink_pairs", "0,4,1,5", "numa"): ([[0, 2], [1, 3]], [[0, 1], [2, 3]]),
}


def check_recorded_node_groups(fixture: str, visible: str, domain: str):
    """``init_groups(domain=...)`` with NVML replayed from ``fixture``, this rank's GPU picked by ``visible``."""
    before = os.environ.get("CUDA_VISIBLE_DEVICES")
    os.environ["CUDA_VISIBLE_DEVICES"] = visible
    try:
        groups = hs.init_groups(domain=domain, nvml=FakeNvml.from_file(NVML_FIXTURES / f"{fixture}.json"))
    finally:
        if before is None:
            os.environ.pop("CUDA_VISIBLE_DEVICES")
        else:
            os.environ["CUDA_VISIBLE_DEVICES"] = before
    me = dist.get_rank()
    entry = next(e for n in groups.cluster.nodes for e in n.ranks if e.rank == me)
    gpu = groups.cluster.nodes[0].probe.gpu_by_uuid(entry.gpu_uuid)
    out = {
        "gpu_index": gpu.index,
        "plan_shard": [list(g) for g in groups.plan.shard_groups],
        "plan_replicate": [list(g) for g in groups.plan.replicate_groups],
        "shard": dist.get_process_group_ranks(groups.shard),
        "replicate": dist.get_process_group_ranks(groups.replicate),
        "shard_reached": _members_reached(groups.shard),
        "replicate_reached": _members_reached(groups.replicate),
        "mesh": None,
    }
    if groups.mesh is not None:
        out["mesh"] = groups.mesh.mesh.tolist()
        out["mesh_names"] = groups.mesh.mesh_dim_names
        out["mesh_shard_reached"] = _members_reached(groups.mesh.get_group("shard"))
        out["mesh_replicate_reached"] = _members_reached(groups.mesh.get_group("replicate"))
    return out


@pytest.fixture(scope="module")
def node_pool():
    with RankPool(4, num_nodes=1) as p:
        yield p


@pytest.mark.parametrize("fixture,visible,domain", sorted(NVML_CASES), ids=["-".join(c) for c in sorted(NVML_CASES)])
def test_recorded_node_groups_follow_the_domain(node_pool, fixture, visible, domain):
    want_shard, want_replicate = NVML_CASES[(fixture, visible, domain)]
    results = node_pool.run(check_recorded_node_groups, fixture, visible, domain)
    assert [r["gpu_index"] for r in results] == [int(i) for i in visible.split(",")]
    for rank, res in enumerate(results):
        my_shard = next(g for g in want_shard if rank in g)
        my_replicate = next(g for g in want_replicate if rank in g)
        assert res["plan_shard"] == want_shard and res["plan_replicate"] == want_replicate
        assert res["shard"] == my_shard and res["shard_reached"] == my_shard
        assert res["replicate"] == my_replicate and res["replicate_reached"] == my_replicate
        # The mesh: rows are shard groups, columns replicate groups, over the same ranks.
        assert res["mesh"] == want_shard and res["mesh_names"] == ("replicate", "shard")
        assert res["mesh_shard_reached"] == my_shard and res["mesh_replicate_reached"] == my_replicate
