"""init_groups on 4 gloo ranks acting as 2 nodes, in torchrun's block order and SLURM's cyclic order."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import hybridshard as hs
from tests.mp import RankPool

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
    with RankPool(4, num_nodes=2, layout=request.param, timeout=60) as p:
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
    messages = pool.run(check_bad_shard_size, timeout=30)
    assert all(m is not None and "shard_size=3" in m and "node0: 2" in m for m in messages)
