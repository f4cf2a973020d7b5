"""Node and cluster reports, and every finding kind triggered and not triggered."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from tests.test_probe import HOST_NUMA, fixture_node, load
from hybridshard.topology.cluster import assemble_cluster
from hybridshard.topology.findings import CODES, Finding, Level, cluster_findings, format_ranges, has_errors
from hybridshard.topology.planner import GroupPlan, plan_groups
from hybridshard.topology.records import ClusterView, NodeProbe, RankProbe
from hybridshard.topology.report import MATRIX_LEGEND, cluster_report_dict, render_cluster, render_node
from hybridshard.topology.visible import resolve_visible_devices


@pytest.fixture(scope="module")
def nodes(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("nodes")
    return {
        "dgx0": fixture_node("dgx_h100_nvswitch", tmp, "dgx0"),
        "dgx1": fixture_node("dgx_h100_nvswitch", tmp, "dgx1"),
        "pcie0": fixture_node("pcie_nvlink_pairs", tmp, "pcie0"),
        "gb0": fixture_node("gb200_nvl72_node", tmp, "gb0"),
        "cpu0": fixture_node("no_nvml", tmp, "cpu0"),
        "cpu1": fixture_node("no_nvml", tmp, "cpu1"),
    }


def ranks_on(node: NodeProbe, global_ranks, world_size, *, cvd=None, affinity="gpu") -> list[RankProbe]:
    """One rank per entry of ``global_ranks`` (local rank = position). ``cvd`` is one value for all
    ranks or a list; ``affinity`` is "gpu" (the GPU's NUMA CPUs), "all" (every CPU) or a tuple."""
    all_cpus = tuple(sorted(c for n in node.numa_nodes for c in n.cpus))
    out = []
    for local, rank in enumerate(global_ranks):
        value = cvd[local] if isinstance(cvd, list) else cvd
        visible, _ = resolve_visible_devices(value, node.gpus)
        gpu_uuid = visible[local % len(visible)] if visible else None
        gpu = node.gpu_by_uuid(gpu_uuid) if gpu_uuid else None
        if affinity == "gpu":
            cpus = next((n.cpus for n in node.numa_nodes if gpu and n.id == gpu.numa_node), all_cpus)
        else:
            cpus = all_cpus if affinity == "all" else affinity
        out.append(
            RankProbe(
                rank=rank,
                local_rank=local,
                world_size=world_size,
                node=node,
                visible_gpu_uuids=visible,
                cuda_visible_devices=value,
                gpu_uuid=gpu_uuid,
                cpu_affinity=cpus,
            )
        )
    return out


def two_dgx(nodes, *, layout="block", **kwargs) -> ClusterView:
    order = (
        (list(range(8)), list(range(8, 16))) if layout == "block" else (list(range(0, 16, 2)), list(range(1, 16, 2)))
    )
    return assemble_cluster(
        ranks_on(nodes["dgx0"], order[0], 16, **kwargs) + ranks_on(nodes["dgx1"], order[1], 16, **kwargs)
    )


def codes(findings) -> list[str]:
    return [f.code for f in findings]


# -- node report -------------------------------------------------------------------------------


def test_node_report_nvswitch(nodes):
    text = render_node(nodes["dgx0"])
    assert "node dgx0 (hostname" in text and "GPUs: 8  (driver 550.54.15, CUDA 12.4" in text
    assert "NVIDIA H100 80GB HBM3" in text and "00000000:1B:00.0" in text and "79.6 GiB" in text
    assert "18/18 up, 18 to switch" in text
    gpu0_row = next(l for l in text.splitlines() if l.strip().startswith("GPU0 ") and "NV18" in l)
    assert gpu0_row.split()[1:10] == ["X"] + ["NV18"] * 7 + ["0-55,112-167"]
    assert MATRIX_LEGEND.splitlines()[1].strip() in text
    # Per-GPU missing facts are shown, not hidden, once per (fact, reason) with the GPUs it concerns.
    assert text.count("fabric: unavailable: Not Supported") == 1
    assert "  GPUs 0-7: fabric: unavailable: Not Supported" in text
    assert "0     0-55,112-167" in text  # NUMA table


def test_node_report_pcie_pairs_and_gb200(nodes):
    text = render_node(nodes["pcie0"])
    row = next(l for l in text.splitlines() if l.strip().startswith("GPU4 ") and "NV12" in l)
    assert row.split()[1:9] == ["SYS"] * 4 + ["X", "NV12", "NODE", "NODE"]
    assert "12/12 up, GPU 1" in text
    fabric = load("gb200_nvl72_node")["devices"][0]["fabric"]["cluster_uuid"]
    assert f"multi-node NVLink: fabric cluster {fabric}, clique 32766" in render_node(nodes["gb0"])


def test_node_report_without_gpus_says_so_and_reports_the_rest(nodes):
    text = render_node(nodes["cpu0"])
    assert "no GPUs: NVML Shared Library Not Found" in text
    assert "NUMA nodes:" in text and "NICs:" in text and "memory" in text and "Connections" not in text


def test_node_report_prints_unavailable_facts(tmp_path):
    node = fixture_node("dgx_h100_nvswitch", tmp_path, **{"memory_total:3": "Unknown Error"})
    node = dataclasses.replace(
        node, numa_nodes=(), unavailable=(("numa_nodes", "no NUMA nodes under /x"), ("cpu_sockets", "gone"))
    )
    text = render_node(node)
    assert "memory_total_bytes: unavailable: Unknown Error" in text
    assert "unavailable: no NUMA nodes under /x" in text and "cpu_sockets: unavailable: gone" in text


# -- findings ----------------------------------------------------------------------------------


def test_clean_cluster_has_no_findings(nodes):
    cluster = two_dgx(nodes)
    assert cluster_findings(cluster, plan_groups(cluster)) == ()
    cpu = assemble_cluster(
        ranks_on(nodes["cpu0"], [0, 1], 4, affinity="all") + ranks_on(nodes["cpu1"], [2, 3], 4, affinity="all")
    )
    assert cluster_findings(cpu, plan_groups(cpu)) == ()


def test_heterogeneous_nodes(nodes):
    mixed = assemble_cluster(ranks_on(nodes["dgx0"], range(8), 16) + ranks_on(nodes["pcie0"], range(8, 16), 16))
    found = cluster_findings(mixed)
    assert codes(found) == ["heterogeneous_nodes"]  # same counts, different GPU models
    assert "NVIDIA A100 80GB PCIe" in found[0].message and found[0].level is Level.WARNING
    uneven = assemble_cluster(ranks_on(nodes["dgx0"], range(8), 12) + ranks_on(nodes["gb0"], range(8, 12), 12))
    assert "heterogeneous_nodes" in codes(cluster_findings(uneven))


def test_non_contiguous_ranks(nodes):
    cyclic = two_dgx(nodes, layout="cyclic")
    found = cluster_findings(cyclic, plan_groups(cyclic))
    assert codes(found) == ["non_contiguous_ranks"]
    assert "dgx0: ranks 0,2,4,6,8,10,12,14" in found[0].message
    assert not has_errors(found)


def test_node_name_collision(nodes):
    probes = ranks_on(nodes["cpu0"], [0, 1], 4, affinity="all") + ranks_on(nodes["cpu0"], [2, 3], 4, affinity="all")
    found = cluster_findings(assemble_cluster(probes))
    assert "node_name_collision" in codes(found) and has_errors(found)


def test_visible_devices_differ(nodes):
    # Rank 7 still lands on GPU 7, but CUDA ordinal 0 is GPU 4 for it and GPU 0 for the others.
    differ = two_dgx(nodes, cvd=["0,1,2,3,4,5,6,7"] * 7 + ["4,5,6,7"])
    found = cluster_findings(differ)
    assert codes(found) == ["visible_devices_differ"] * 2
    assert "node 'dgx0'" in found[0].message and "rank 7: '4,5,6,7'" in found[0].message
    reversed_list = two_dgx(nodes, cvd=["0,1,2,3,4,5,6,7"] * 7 + ["7,6,5,4,3,2,1,0"])
    assert codes(cluster_findings(reversed_list)) == ["shared_gpu", "visible_devices_differ", "visible_devices_differ"]
    one_each = two_dgx(nodes, cvd=[str(i) for i in range(8)])  # SLURM --gpus-per-task=1 style
    same = two_dgx(nodes, cvd="0,1,2,3,4,5,6,7")
    assert cluster_findings(one_each) == () and cluster_findings(same) == ()


def test_same_devices_spelled_differently_do_not_differ(nodes):
    # Unset, the full ordinal list and the same GPUs by (prefix of) UUID all name one device list.
    uuids = [g.uuid for g in nodes["dgx0"].gpus]
    for other in ("0,1,2,3,4,5,6,7", ",".join(uuids), ",".join(u[:12] for u in uuids)):
        assert cluster_findings(two_dgx(nodes, cvd=[None] * 7 + [other])) == (), other


def test_gpu_not_visible_names_a_gpu_without_uuid(nodes):
    node = nodes["dgx0"]
    gpus = tuple(dataclasses.replace(g, uuid=None) if g.index == 1 else g for g in node.gpus)
    node = dataclasses.replace(node, gpus=gpus)
    found = cluster_findings(assemble_cluster(ranks_on(node, range(8), 8)))
    assert codes(found) == ["gpu_not_visible"] and "rank 1: CUDA_VISIBLE_DEVICES=<unset>" in found[0].message
    assert "NVML reported no UUID for GPU 1" in found[0].message


def test_gpu_not_visible_and_not_on_node(nodes):
    hidden = two_dgx(nodes, cvd=[""] + ["0,1,2,3,4,5,6,7"] * 7)
    found = cluster_findings(hidden)
    assert codes(found)[0] == "gpu_not_visible" and found[0].level is Level.ERROR
    assert "rank 0: CUDA_VISIBLE_DEVICES=''" in found[0].message
    probes = ranks_on(nodes["dgx0"], range(8), 8)
    probes[2] = dataclasses.replace(probes[2], gpu_uuid="GPU-00000000-elsewhere")
    found = cluster_findings(assemble_cluster(probes))
    assert (
        "gpu_not_on_node" in codes(found)
        and "rank 2: GPU-00000000-elsewhere" in found[codes(found).index("gpu_not_on_node")].message
    )
    # No GPUs on the node: nothing to be hidden from.
    assert cluster_findings(assemble_cluster(ranks_on(nodes["cpu0"], [0], 1, cvd="", affinity="all"))) == ()


def test_shared_gpu_is_an_error(nodes):
    shared = two_dgx(nodes, cvd="0")  # every rank of a node sees (and picks) GPU 0
    found = cluster_findings(shared)
    assert codes(found) == ["shared_gpu"] and has_errors(found)
    assert "ranks [0, 1, 2, 3, 4, 5, 6, 7]" in found[0].message


def test_cpu_affinity_off_numa(nodes):
    unbound = two_dgx(nodes, affinity="all")
    found = cluster_findings(unbound)
    assert codes(found) == ["cpu_affinity_off_numa"] * 2 and not has_errors(found)
    assert "rank 4: GPU 4 near CPUs 56-111,168-223 (NUMA node 1)" in found[0].message
    assert "--bind-numa" in found[0].message
    wrong = two_dgx(nodes, affinity=tuple(HOST_NUMA["dgx_h100_nvswitch"][0]))  # all bound to socket 0
    found = cluster_findings(wrong)
    assert "rank 3" not in found[0].message and "rank 4" in found[0].message


def test_plan_failure_is_an_error_and_sorted_first(nodes):
    cluster = two_dgx(nodes, layout="cyclic")
    with pytest.raises(ValueError) as err:
        plan_groups(cluster, shard_size=3)
    found = cluster_findings(cluster, None, plan_error=str(err.value))
    assert codes(found) == ["plan_failed", "non_contiguous_ranks"]
    assert "shard_size=3 does not tile" in found[0].message


def test_finding_records():
    f = Finding(Level.ERROR, "shared_gpu", "two ranks")
    assert Finding.from_dict(json.loads(json.dumps(f.to_dict()))) == f and f.to_dict()["level"] == "error"
    with pytest.raises(ValueError, match="finding code must be one of"):
        Finding(Level.WARNING, "made_up", "x")
    assert len(set(CODES)) == len(CODES)
    assert format_ranges([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8" and format_ranges([]) == "-"


# -- cluster report ----------------------------------------------------------------------------


def test_cluster_report_text_and_json(nodes):
    cluster = two_dgx(nodes, layout="cyclic")
    plan = plan_groups(cluster)
    found = cluster_findings(cluster, plan)
    text = render_cluster(cluster, plan, found, bandwidth_table="bandwidth: 123 GB/s")
    assert "cluster: 2 node(s), world size 16" in text
    assert re.search(r"dgx0  \S+ +\S+ +0,2,4,6,8,10,12,14 \(8\)  8 x NVIDIA H100 80GB HBM3  no", text), text
    assert "0:0 2:1 4:2" in text
    assert "plan: world size 16 = 2 replicas x shard size 8" in text
    assert "0, 2, 4, 6, 8, 10, 12, 14  [dgx0]" in text
    assert "bandwidth: 123 GB/s" in text and "[warning] non_contiguous_ranks" in text
    report = json.loads(json.dumps(cluster_report_dict(cluster, plan, found, bandwidth={"x": 1})))
    assert report["ok"] is True and report["num_nodes"] == 2 and report["bandwidth"] == {"x": 1}
    assert ClusterView.from_dict(report["cluster"]) == cluster and GroupPlan.from_dict(report["plan"]) == plan
    assert [w["code"] for w in report["warnings"]] == ["non_contiguous_ranks"]


def test_cluster_report_without_plan(nodes):
    cluster = two_dgx(nodes, cvd="0")
    found = cluster_findings(cluster, None, plan_error="boom")
    text = render_cluster(cluster, None, found)
    assert "plan: none" in text and "errors:" in text and "[error] plan_failed: no group plan: boom" in text
    report = cluster_report_dict(cluster, None, found)
    assert report["ok"] is False and report["plan"] is None and "bandwidth" not in report
    clean = two_dgx(nodes)
    assert render_cluster(clean, plan_groups(clean), ()).endswith("no warnings")
