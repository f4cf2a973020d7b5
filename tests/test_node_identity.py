"""One physical machine is one node: containers with their own hostnames shard together unless
HYBRIDSHARD_NODE_NAME names them apart; the cluster report says when hostnames and machines disagree."""

from __future__ import annotations

import dataclasses
import glob
import json
import os
import subprocess
import sys

import pytest

from hybridshard.launcher.local_cluster import ClusterOptions, host_env, launch_argv
from hybridshard.launcher.netns import LocalNetwork, check_rights
from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.findings import cluster_findings, has_errors
from hybridshard.topology.planner import plan_groups
from hybridshard.topology.records import RankProbe
from hybridshard.topology.report import render_cluster
from hybridshard.topology.synthetic import synthetic_node

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NO_RIGHTS = check_rights()
needs_netns = pytest.mark.skipif(NO_RIGHTS is not None, reason=f"cannot create network namespaces: {NO_RIGHTS}")


def container(rank: int, hostname: str, *, node_name: str = "machine-aaaa", machine: str = "machine-aaaa",
              gpu: int = 0) -> RankProbe:
    """A rank in a container of one 4-GPU machine; each container counts its local ranks from 0."""
    node = dataclasses.replace(synthetic_node("m", gpus_per_node=4), node_name=node_name, hostname=hostname,
                               machine=machine)
    uuid = node.gpus[gpu].uuid
    return RankProbe(rank=rank, local_rank=0, world_size=2, node=node, visible_gpu_uuids=(uuid,), gpu_uuid=uuid)


def test_two_pods_on_one_machine_are_one_node_with_a_warning():
    view = assemble_cluster([container(0, "pod-a", gpu=0), container(1, "pod-b", gpu=1)])
    assert view.num_nodes == 1 and [r.hostname for r in view.nodes[0].ranks] == ["pod-a", "pod-b"]
    plan = plan_groups(view)
    assert plan.shard_groups == ((0, 1),)
    found = cluster_findings(view, plan)
    assert [f.code for f in found] == ["node_identity"] and not has_errors(found)
    assert "hostnames pod-a, pod-b run on one machine (machine-aaaa)" in found[0].message
    text = render_cluster(view, plan, found)
    assert "pod-a,pod-b  machine-aaaa" in text


def test_named_nodes_on_one_machine_are_kept_apart_and_said_so():
    view = assemble_cluster([container(0, "host0", node_name="host0"), container(1, "host1", node_name="host1")])
    assert view.num_nodes == 2
    (finding,) = [f for f in cluster_findings(view, plan_groups(view)) if f.code == "node_identity"]
    assert "yet are nodes host0, host1 by HYBRIDSHARD_NODE_NAME" in finding.message


def test_one_hostname_repeating_local_ranks_is_still_a_collision():
    view = assemble_cluster([container(0, "same", gpu=0), container(1, "same", gpu=1)])
    codes = [f.code for f in cluster_findings(view, plan_groups(view))]
    assert "node_name_collision" in codes and "node_identity" not in codes


def test_one_hostname_on_two_machines_is_said():
    view = assemble_cluster([container(0, "h", node_name="a", machine="machine-1"),
                             container(1, "h", node_name="b", machine="machine-2")])
    (finding,) = [f for f in cluster_findings(view, plan_groups(view)) if f.code == "node_identity"]
    assert "hostname 'h' is on machines machine-1, machine-2" in finding.message


@needs_netns
def test_two_network_namespaces_without_node_name_are_one_node(tmp_path):
    """Two "containers" made here: own network and UTS namespaces (hostnames host0, host1), one kernel,
    no HYBRIDSHARD_NODE_NAME. `topo --cluster` must see one node of two ranks."""
    opts = ClusterOptions(num_nodes=2, procs_per_node=1, port=29531, log_dir=str(tmp_path / "logs"),
                          command=("python", "-m", "hybridshard", "topo", "--cluster", "--json"))
    env = host_env(os.environ)
    env["PYTHONPATH"] = REPO
    assert "HYBRIDSHARD_NODE_NAME" not in env
    net = LocalNetwork(2)
    procs = []
    try:
        net.up()
        for h in net.hosts:
            procs.append(subprocess.Popen(net.host_argv(h, launch_argv(opts, h.index, net.hosts[0].name)), env=env,
                                          cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
        outs = [p.communicate(timeout=120)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        net.teardown()
    assert [p.returncode for p in procs] == [0, 0], outs
    # rank 0's stdout from its log in the run directory (the console's copy is prefixed and may interleave)
    [path] = glob.glob(str(tmp_path / "logs" / "node0" / "*" / "attempt_0" / "0" / "stdout.log"))
    with open(path) as f:
        text = f.read()
    report = json.loads(text[text.index("\n{") + 1:] if not text.startswith("{") else text)
    (node,) = report["cluster"]["nodes"]
    assert sorted(r["rank"] for r in node["ranks"]) == [0, 1]
    assert sorted(r["hostname"] for r in node["ranks"]) == ["host0", "host1"]
    assert node["name"] == node["probe"]["machine"] and node["name"].startswith("machine-")
    assert report["plan"]["shard_groups"] == [[0, 1]]
    assert [w["code"] for w in report["warnings"]] == ["node_identity"]
