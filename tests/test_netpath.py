"""Where each node sits in the network: every source, their order, bad input, and what the cluster
view, the warnings and the report make of the paths (docs/topology.md, "Racks and pods")."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridshard.topology.findings import cluster_findings
from hybridshard.topology.netpath import (
    NetworkPath,
    format_tree,
    k8s_path,
    parse_k8s_labels,
    parse_path,
    racks,
    resolve_network_path,
)
from hybridshard.topology.nvml_recorded import FakeNvml
from hybridshard.topology.probe import probe_node
from hybridshard.topology.records import ClusterView
from hybridshard.topology.report import cluster_report_dict, render_cluster
from hybridshard.topology.synthetic import synthetic_cluster
from hybridshard.topology.topofile import conf_path

NVML = Path(__file__).parent / "fixtures" / "nvml" / "dgx_h100_nvswitch.json"

# Recorded from Slurm job steps: topology/tree with three switch levels, topology/block, and a node
# under two switches of its first level (Slurm prints that level as a host-list range).
SLURM_TREE = {"SLURM_TOPOLOGY_ADDR": "s0.s4.s8.tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.switch.node"}
SLURM_BLOCK = {"SLURM_TOPOLOGY_ADDR": "b8.tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "block.node"}
SLURM_RANGE = {"SLURM_TOPOLOGY_ADDR": "s[0-1].s4.tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"}
SLURM_FLAT = {"SLURM_TOPOLOGY_ADDR": "tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "node"}

TOPOLOGY_CONF = """\
# two leaf switches under one spine
SwitchName=s0 Nodes=tux[0-3] LinkSpeed=400
SwitchName=s1 Nodes=tux[4-7,12]   # a comment after a line
switchname=s4 Switches=s[0-1]

"""

TOPOLOGY_YAML = """\
- topology: blocks
  cluster_default: false
  block:
    block_sizes: [4, 16]
    blocks:
      - block: b1
        nodes: gpu[01-04]
      - block: b2
        nodes: gpu[05-08]
- topology: fabric
  cluster_default: true
  tree:
    switches:
      - switch: core0
        children: leaf[0-1]
      - switch: leaf0
        nodes: gpu[01-04]
      - switch: leaf1
        nodes: [gpu05, "gpu[06-08]"]
- topology: flat
  flat: true
"""

TOPOGRAPH = {"network.topology.nvidia.com/accelerator": "nvl1", "network.topology.nvidia.com/leaf": "s1",
             "network.topology.nvidia.com/spine": "s2", "network.topology.nvidia.com/core": "s3"}
GKE = {"cloud.google.com/gce-topology-block": "b-7f3a", "cloud.google.com/gce-topology-subblock": "sb-02",
       "cloud.google.com/gce-topology-host": "h-19c", "kubernetes.io/hostname": "gke-a3-0"}
EKS = {f"topology.k8s.aws/network-node-layer-{i}": f"nn-{i}{i}" for i in (1, 2, 3)}


def first_line(err: pytest.ExceptionInfo) -> str:
    return str(err.value).splitlines()[0]


# -- each source --------------------------------------------------------------------------------------


def test_env_override():
    assert resolve_network_path({"HYBRIDSHARD_NETWORK_PATH": "pod1/rack07"}) == NetworkPath(
        ("pod1", "rack07"), "HYBRIDSHARD_NETWORK_PATH")
    assert parse_path("/pod1/rack07/") == ("pod1", "rack07")


@pytest.mark.parametrize("env, path", [
    (SLURM_TREE, ("s0", "s4", "s8")),
    (SLURM_BLOCK, ("b8",)),
    (SLURM_RANGE, ("s[0-1]", "s4")),  # [Note: a range as a level]: kept verbatim
])
def test_slurm_variables(env, path):
    assert resolve_network_path(env, names=()) == NetworkPath(path, "SLURM_TOPOLOGY_ADDR")


def test_slurm_flat_topology_passes_to_the_next_source(tmp_path):
    assert resolve_network_path(SLURM_FLAT, names=()) == NetworkPath()
    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY_CONF)
    got = resolve_network_path({**SLURM_FLAT, "HYBRIDSHARD_TOPOLOGY_FILE": str(conf)}, names=("tux1",))
    assert got == NetworkPath(("s4", "s0"), f"topology.conf:{conf}")


def test_topology_conf_two_levels():
    assert conf_path(TOPOLOGY_CONF, ["tux2"]) == ("s4", "s0")
    assert conf_path(TOPOLOGY_CONF, ["tux12"]) == ("s4", "s1")
    assert conf_path(TOPOLOGY_CONF, ["login1", "tux5"]) == ("s4", "s1")  # any of the node's names
    assert conf_path(TOPOLOGY_CONF, ["tux9"]) == ()  # not listed: no path, no error
    assert conf_path("BlockName=b1 Nodes=tux[0-3]\nBlockName=b2 Nodes=tux[4-7]\nBlockSizes=4,8\n", ["tux6"]) == ("b2",)


def test_topology_yaml_tree_and_block(tmp_path):
    tree = tmp_path / "topology.yaml"
    tree.write_text(TOPOLOGY_YAML)  # the cluster_default topology is read: "fabric"
    env = {"HYBRIDSHARD_TOPOLOGY_FILE": str(tree)}
    assert resolve_network_path(env, names=("gpu06",)) == NetworkPath(("core0", "leaf1"), f"topology.yaml:{tree}")
    block = tmp_path / "block.yml"
    block.write_text(TOPOLOGY_YAML.replace("cluster_default: true", "cluster_default: false"))  # then the first
    got = resolve_network_path({"HYBRIDSHARD_TOPOLOGY_FILE": str(block)}, names=("gpu06",))
    assert got == NetworkPath(("b2",), f"topology.yaml:{block}")


@pytest.mark.parametrize("labels, path, family", [
    (TOPOGRAPH, ("s3", "s2", "s1"), "Topograph"),  # the switches; the NVLink domain only without them
    ({"network.topology.nvidia.com/accelerator": "nvl1"}, ("nvl1",), "Topograph"),
    ({k: v for k, v in TOPOGRAPH.items() if not k.endswith("/core")}, ("s2", "s1"), "Topograph"),
    (GKE, ("b-7f3a", "sb-02"), "GKE"),  # the host is the machine itself
    (EKS, ("nn-11", "nn-22", "nn-33"), "EKS"),
    ({**EKS, "topology.k8s.aws/network-node-layer-4": "nn-44"}, ("nn-11", "nn-22", "nn-33", "nn-44"), "EKS"),
    ({"kubernetes.io/hostname": "n0", "topology.kubernetes.io/zone": "z1"}, (), None),
])
def test_kubernetes_labels_of_each_vendor(labels, path, family):
    assert k8s_path(labels) == NetworkPath(path, f"kubernetes labels ({family})" if family else None)


def test_kubernetes_label_formats(tmp_path):
    lines = "\n".join(f'{k}="{v}"' for k, v in GKE.items())  # as in a downward API labels file
    node = json.dumps({"kind": "Node", "metadata": {"name": "gke-a3-0", "labels": GKE}})
    assert parse_k8s_labels(lines) == parse_k8s_labels(json.dumps(GKE)) == parse_k8s_labels(node) == GKE
    assert parse_k8s_labels("# labels\na=b=c\n\n") == {"a": "b=c"}
    file = tmp_path / "node-labels.json"
    file.write_text(json.dumps(EKS))
    got = resolve_network_path({"HYBRIDSHARD_K8S_LABELS_FILE": str(file)}, names=())
    assert got == NetworkPath(("nn-11", "nn-22", "nn-33"), "kubernetes labels (EKS)")
    got = resolve_network_path({"HYBRIDSHARD_K8S_LABELS": lines, "HYBRIDSHARD_K8S_LABELS_FILE": str(file)}, names=())
    assert got.source == "kubernetes labels (GKE)"  # the variable before the file


def test_sources_in_order(tmp_path):
    conf = tmp_path / "topology.conf"
    conf.write_text(TOPOLOGY_CONF)
    env = {"HYBRIDSHARD_NETWORK_PATH": "pod1/rack07", **SLURM_TREE, "HYBRIDSHARD_TOPOLOGY_FILE": str(conf),
           "HYBRIDSHARD_K8S_LABELS": json.dumps(EKS)}
    expected = ["HYBRIDSHARD_NETWORK_PATH", "SLURM_TOPOLOGY_ADDR", f"topology.conf:{conf}", "kubernetes labels (EKS)", None]
    dropped = [("HYBRIDSHARD_NETWORK_PATH",), ("SLURM_TOPOLOGY_ADDR", "SLURM_TOPOLOGY_ADDR_PATTERN"),
               ("HYBRIDSHARD_TOPOLOGY_FILE",), ("HYBRIDSHARD_K8S_LABELS",), ()]
    for source, names in zip(expected, dropped):
        assert resolve_network_path(env, names=("tux1",)).source == source
        for name in names:  # drop the source just seen: the next one answers
            del env[name]


# -- bad input: ValueError whose first line names the source, what was found and the form expected ------


@pytest.mark.parametrize("env, fragments", [
    ({"HYBRIDSHARD_NETWORK_PATH": "pod1//rack07"},
     ["HYBRIDSHARD_NETWORK_PATH: expected a slash-separated path", "found 'pod1//rack07'"]),
    ({"HYBRIDSHARD_NETWORK_PATH": "pod 1/rack07"}, ["HYBRIDSHARD_NETWORK_PATH: expected", "level 'pod 1'"]),
    ({"SLURM_TOPOLOGY_ADDR": "s0.tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "switch.switch.node"},
     ["SLURM_TOPOLOGY_ADDR: expected dot-separated names", "SLURM_TOPOLOGY_ADDR='s0.tux1'",
      "(2 names for 3 pattern words)"]),
    ({"SLURM_TOPOLOGY_ADDR": "r7.tux1", "SLURM_TOPOLOGY_ADDR_PATTERN": "rack.node"},
     ["SLURM_TOPOLOGY_ADDR: expected", "switch, block and node", "(pattern word 'rack')"]),
    ({"SLURM_TOPOLOGY_ADDR": "s0.s4.tux1"}, ["expected both SLURM_TOPOLOGY_ADDR and SLURM_TOPOLOGY_ADDR_PATTERN",
                                             "SLURM_TOPOLOGY_ADDR_PATTERN unset"]),
    ({"HYBRIDSHARD_K8S_LABELS": json.dumps({**EKS, "topology.k8s.aws/network-node-layer-2": ""})},
     ["kubernetes labels (EKS): expected the labels", "without ['topology.k8s.aws/network-node-layer-2']"]),
    ({"HYBRIDSHARD_K8S_LABELS": "network.topology.nvidia.com/leaf s1"},
     ["HYBRIDSHARD_K8S_LABELS: expected key=value lines", "found 'network.topology.nvidia.com/leaf s1'"]),
    ({"HYBRIDSHARD_K8S_LABELS": "{\"a\": "}, ["HYBRIDSHARD_K8S_LABELS: expected a JSON object", "invalid JSON"]),
    ({"HYBRIDSHARD_K8S_LABELS": "network.topology.nvidia.com/leaf=a/b"},
     ["kubernetes labels (Topograph): expected label values without '/'", "found 'a/b'"]),
    ({"HYBRIDSHARD_K8S_LABELS_FILE": "/nonexistent/labels.json"},
     ["HYBRIDSHARD_K8S_LABELS_FILE: expected a readable file", "'/nonexistent/labels.json'"]),
    ({"HYBRIDSHARD_TOPOLOGY_FILE": "/nonexistent/topology.conf"},
     ["HYBRIDSHARD_TOPOLOGY_FILE: expected a readable Slurm topology.conf", "'/nonexistent/topology.conf'"]),
])
def test_bad_sources(env, fragments):
    with pytest.raises(ValueError) as err:
        resolve_network_path(env, names=("tux1",))
    line = first_line(err)
    assert all(f in line for f in fragments), line


@pytest.mark.parametrize("name, text, fragments", [
    ("topology.conf", "SwitchName=s0 Nodes=tux[0-3]\nSwitchName=s1 Nodes\n",
     [":2: expected Key=Value words", "found 'Nodes'"]),
    ("topology.conf", "SwitchName=s0 Nodes=tux[3-1]\n", [":1: expected a Slurm host list", "found 'tux[3-1]'"]),
    ("topology.conf", "SwitchName=s0 Switches=s1 Nodes=tux1\nSwitchName=s1 Switches=s0\n",
     ["expected switches to form a tree, found a cycle s0 -> s1 -> s0"]),
    ("topology.conf", "SwitchName=s0 Nodes=tux1\nBlockName=b0 Nodes=tux2\n", ["expected SwitchName lines", "found both"]),
    ("topology.yaml", "topology: fabric\n", ["expected a list of topologies", "found dict"]),
    ("topology.yaml", "- topology: t\n  torus: {}\n", ["(topology 't'): expected one of 'tree', 'block' or 'flat'"]),
    ("topology.yaml", "- topology: t\n  tree:\n    switches: [{nodes: tux1}]\n",
     ["(topology 't'): expected a list of entries each with a 'switch' name"]),
    ("topology.yaml", "- topology: [t\n", ["expected YAML", "syntax error"]),
])
def test_bad_topology_files(tmp_path, name, text, fragments):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ValueError) as err:
        resolve_network_path({"HYBRIDSHARD_TOPOLOGY_FILE": str(path)}, names=("tux1",))
    line = first_line(err)
    assert line.startswith(f"{name}:{path}") and all(f in line for f in fragments), line


def test_probe_records_the_path_and_raises_for_a_bad_source(tmp_path):
    nvml = FakeNvml(json.loads(NVML.read_text()))
    node = probe_node(nvml, sysfs_root=tmp_path, env={"HYBRIDSHARD_NETWORK_PATH": "pod1/rack07", **SLURM_TREE})
    assert (node.network_path, node.network_source) == (("pod1", "rack07"), "HYBRIDSHARD_NETWORK_PATH")
    node = probe_node(nvml, sysfs_root=tmp_path, env=SLURM_FLAT)
    assert (node.network_path, node.network_source) == ((), None)
    with pytest.raises(ValueError, match="^SLURM_TOPOLOGY_ADDR: expected"):
        probe_node(nvml, sysfs_root=tmp_path, env={**SLURM_TREE, "SLURM_TOPOLOGY_ADDR": "s0.tux1"})


def test_launch_network_path_sets_the_variable_for_the_ranks():
    from hybridshard.cli.launch import prepare

    base = ["--nnodes", "1", "--nproc-per-node", "2"]
    _, command = prepare([*base, "--network-path", "/pod1/rack07", "train.py"], env={})
    assert dict(command.env)["HYBRIDSHARD_NETWORK_PATH"] == "pod1/rack07"
    _, command = prepare([*base, "train.py"], env={})
    assert "HYBRIDSHARD_NETWORK_PATH" not in dict(command.env)
    with pytest.raises(ValueError, match="^--network-path: expected a slash-separated path"):
        prepare([*base, "--network-path", "pod1//rack07", "train.py"], env={})


# -- the cluster view, the warnings and the report ----------------------------------------------------


def test_cluster_notes_name_mixed_depths_and_missing_paths():
    mixed = synthetic_cluster(3, 2, network_paths=[("pod0", "r1"), ("pod0", "r1", "leaf3"), ("pod0", "r2")])
    assert mixed.notes == ("network paths differ in depth (2 levels on node0, node2; 3 levels on node1)",)
    partial = synthetic_cluster(3, 2, network_paths=[("pod0", "r1"), (), ("pod0", "r2")])
    assert partial.notes == ("no network path on node1, while node0, node2 have one",)
    assert synthetic_cluster(3, 2).notes == () and synthetic_cluster(4, 2, racks=2).notes == ()
    (finding,) = [f for f in cluster_findings(partial) if f.code == "network_path"]
    assert finding.message.startswith("no network path on node1, while node0, node2 have one.")


def test_uneven_racks_warning():
    uneven = synthetic_cluster(4, 2, network_paths=[("pod0", "r1")] * 3 + [("pod0", "r2")])
    (finding,) = [f for f in cluster_findings(uneven) if f.code == "uneven_racks"]
    assert finding.message.startswith(
        "the job's nodes spread unevenly over racks (rack pod0/r1 has 3 nodes, pod0/r2 has 1 node).")
    for even in (synthetic_cluster(4, 2, racks=2), synthetic_cluster(4, 2), synthetic_cluster(4, 2, racks=1)):
        assert not [f for f in cluster_findings(even) if f.code in ("uneven_racks", "network_path")]


def test_racks_and_synthetic_racks():
    view = synthetic_cluster(5, 1, racks=2)
    assert racks(view) == {("pod0", "rack0"): ["node0", "node1", "node2"], ("pod0", "rack1"): ["node3", "node4"]}
    assert view.nodes[0].probe.network_source == "synthetic"
    assert racks(synthetic_cluster(2, 1)) == {(): ["node0", "node1"]}
    with pytest.raises(ValueError, match="expected 1 <= racks <= num_nodes"):
        synthetic_cluster(2, 1, racks=3)


def test_tree_rendering():
    paths = [("pod0", "r1"), ("pod1", "r3"), ("pod0", "r1"), ("pod0", "r2"), ()]
    view = synthetic_cluster(5, 2, network_paths=paths)
    assert format_tree(view) == "\n".join([
        "network: 3 racks of 5 nodes, paths from synthetic",
        "  pod0",
        "    r1  (2 nodes)",
        "      node0  ranks 0-1",
        "      node2  ranks 4-5",
        "    r2  (1 node)",
        "      node3  ranks 6-7",
        "  pod1",
        "    r3  (1 node)",
        "      node1  ranks 2-3",
        "  (no path)",
        "    node4  ranks 8-9",
    ])
    big = format_tree(synthetic_cluster(12, 1, racks=1), max_nodes=8)
    assert big.splitlines()[-1] == "      ... 4 more nodes, ranks 8-11"
    assert format_tree(synthetic_cluster(2, 1)).startswith("network: no node reports a network path")


def test_report_text_and_json_carry_the_paths():
    view = synthetic_cluster(4, 2, racks=2)
    assert format_tree(view) in render_cluster(view, None, ())
    report = json.loads(json.dumps(cluster_report_dict(view, None, ())))
    probe = report["cluster"]["nodes"][3]["probe"]
    assert (probe["network_path"], probe["network_source"]) == (["pod0", "rack1"], "synthetic")
    assert ClusterView.from_dict(report["cluster"]).nodes[3].network_path == ("pod0", "rack1")
