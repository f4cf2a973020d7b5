"""Node and rank probes from recorded NVML answers (FakeNvml) and a fake sysfs tree."""

from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

from hybridshard.topology.nvml import NvmlSource, bits_from_words, normalize_pci_bus_id
from hybridshard.topology.nvml_recorded import FakeNvml, record
from hybridshard.topology.probe import count_sockets, machine_identity, node_name, parse_cpu_list, probe_nics, probe_node, probe_numa, probe_rank
from hybridshard.topology.records import NodeProbe, RankProbe
from hybridshard.topology.visible import resolve_visible_devices

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"
FIXTURE_NAMES = ("dgx_h100_nvswitch", "pcie_nvlink_pairs", "gb200_nvl72_node", "no_nvml", "h100_x1_recorded")
REPO = Path(__file__).resolve().parents[1]

# NUMA layout of the host each fixture describes: node id -> CPUs.
HOST_NUMA = {
    "dgx_h100_nvswitch": {0: [*range(0, 56), *range(112, 168)], 1: [*range(56, 112), *range(168, 224)]},
    "pcie_nvlink_pairs": {0: [*range(0, 32), *range(64, 96)], 1: [*range(32, 64), *range(96, 128)]},
    "gb200_nvl72_node": {0: list(range(0, 72)), 1: list(range(72, 144))},
    "no_nvml": {0: [0, 1]},
    "h100_x1_recorded": {0: list(range(16))},
}


def load(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def fake(name: str, **fail: str) -> FakeNvml:
    return FakeNvml(load(name), fail=fail)


def _cpulist(cpus) -> str:
    from hybridshard.topology.findings import format_ranges

    return format_ranges(cpus)


def fake_sysfs(
    root: Path,
    numa: dict[int, list[int]],
    *,
    ib: dict[str, dict] | None = None,
    pci_numa: dict[str, int] | None = None,
    net_numa: dict[str, int] | None = None,
) -> Path:
    """A sysfs tree with NUMA nodes, CPU packages (one per NUMA node), RDMA devices and PCI NUMA nodes."""
    for node, cpus in numa.items():
        d = root / f"devices/system/node/node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(_cpulist(cpus) + "\n")
        (d / "meminfo").write_text(
            f"Node {node} MemTotal:       {1048576 * (node + 1)} kB\nNode {node} MemFree: 1 kB\n"
        )
        for cpu in cpus:
            t = root / f"devices/system/cpu/cpu{cpu}/topology"
            t.mkdir(parents=True)
            (t / "physical_package_id").write_text(f"{node}\n")
    for dev, spec in (ib or {}).items():
        port = root / f"class/infiniband/{dev}/ports/1"
        port.mkdir(parents=True)
        (port / "link_layer").write_text(spec.get("link_layer", "InfiniBand") + "\n")
        (port / "rate").write_text(spec.get("rate", "400 Gb/sec (4X NDR)") + "\n")
        (port / "state").write_text(spec.get("state", "4: ACTIVE") + "\n")
        devdir = root / f"class/infiniband/{dev}/device"
        (devdir / "net").mkdir(parents=True)
        (devdir / "numa_node").write_text(f"{spec.get('numa', -1)}\n")
        for netdev in spec.get("netdevs", ()):
            (devdir / "net" / netdev).mkdir()
    for bus_id, node in (pci_numa or {}).items():
        d = root / "bus/pci/devices" / bus_id
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    for ifname, node in (net_numa or {}).items():
        d = root / f"class/net/{ifname}/device"
        d.mkdir(parents=True)
        (d / "numa_node").write_text(f"{node}\n")
    return root


def fixture_node(name: str, tmp_path: Path, node: str = "n0", **fail: str) -> NodeProbe:
    root = tmp_path / f"sys-{name}-{node}"
    if not root.exists():
        fake_sysfs(root, HOST_NUMA[name])
    return probe_node(fake(name, **fail), sysfs_root=root, env={"HYBRIDSHARD_NODE_NAME": node})


# -- every fixture -----------------------------------------------------------------------------


def test_dgx_h100_nvswitch(tmp_path):
    data = load("dgx_h100_nvswitch")
    node = fixture_node("dgx_h100_nvswitch", tmp_path)
    assert node.num_gpus == 8 and node.node_name == "n0" and node.hostname == socket.gethostname()
    assert [g.uuid for g in node.gpus] == [d["uuid"] for d in data["devices"]]
    assert [g.pci_bus_id for g in node.gpus] == [d["pci_bus_id"] for d in data["devices"]]
    assert {g.name for g in node.gpus} == {"NVIDIA H100 80GB HBM3"}
    assert all(g.memory_total_bytes == 81559 * 2**20 for g in node.gpus)
    assert [g.numa_node for g in node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert node.gpus[0].cpu_affinity == tuple(sorted(HOST_NUMA["dgx_h100_nvswitch"][0]))
    assert node.gpus[7].cpu_affinity == tuple(sorted(HOST_NUMA["dgx_h100_nvswitch"][1]))
    for g in node.gpus:
        assert len(g.nvlinks) == 18 and all(l.active and l.peer_index is None for l in g.nvlinks)
        assert g.nvlink_peers == ()  # every link goes to a switch
        assert g.fabric_cluster_uuid is None and g.unavailable_map == {"fabric": "Not Supported"}
    assert all(node.gpu_matrix[i][j] == ("X" if i == j else "NV18") for i in range(8) for j in range(8))
    assert (node.driver_version, node.cuda_driver_version) == ("550.54.15", 12040)
    assert node.cpu_sockets == 2 and [n.id for n in node.numa_nodes] == [0, 1]
    assert "gpus" not in node.unavailable_map


def test_pcie_nvlink_pairs(tmp_path):
    node = fixture_node("pcie_nvlink_pairs", tmp_path)
    assert node.num_gpus == 8
    assert [g.nvlink_peers for g in node.gpus] == [(i ^ 1,) for i in range(8)]
    m = node.gpu_matrix
    assert all(m[i][i ^ 1] == "NV12" for i in range(8))
    assert (m[0][2], m[4][6], m[0][4], m[7][1]) == ("PXB", "NODE", "SYS", "SYS")
    assert sum(code.startswith("NV") for row in m for code in row) == 8
    assert all(m[i][j] == m[j][i] for i in range(8) for j in range(8))
    assert [g.numa_node for g in node.gpus] == [0, 0, 0, 0, 1, 1, 1, 1]


def test_gb200_fabric_clique(tmp_path):
    data = load("gb200_nvl72_node")
    node = fixture_node("gb200_nvl72_node", tmp_path)
    fabric = data["devices"][0]["fabric"]
    assert node.num_gpus == 4
    assert {(g.fabric_cluster_uuid, g.fabric_clique_id) for g in node.gpus} == {(fabric["cluster_uuid"], 32766)}
    # Links leave the node, so there are no same-node peers and no remote PCI ids ...
    assert all(l.remote_pci_bus_id is None and l.peer_index is None for g in node.gpus for l in g.nvlinks)
    # ... yet the shared clique puts every pair on 18 NVLinks, as nvidia-smi reports.
    assert all(node.gpu_matrix[i][j] == ("X" if i == j else "NV18") for i in range(4) for j in range(4))
    assert all(g.unavailable == () for g in node.gpus)


def test_no_nvml_is_a_cpu_node_with_every_other_fact(tmp_path):
    node = fixture_node("no_nvml", tmp_path)
    assert node.gpus == () and node.gpu_matrix == ()
    assert node.unavailable_map["gpus"] == "NVML Shared Library Not Found"
    assert node.cpu_cores_logical == psutil.cpu_count() and node.memory_total_bytes == psutil.virtual_memory().total
    assert node.numa_nodes[0].cpus == (0, 1) and node.numa_nodes[0].memory_bytes == 2**30
    assert node.driver_version is None and "driver_version" not in node.unavailable_map


def test_recorded_h100_single_gpu_vm(tmp_path):
    """A real recording (one H100 in a VM): no NVLink, fabric not registered, every other fact read."""
    data = load("h100_x1_recorded")
    node = fixture_node("h100_x1_recorded", tmp_path)
    assert node.num_gpus == 1
    (gpu,) = node.gpus
    assert (gpu.name, gpu.uuid, gpu.pci_bus_id) == (
        "NVIDIA H100 80GB HBM3", data["devices"][0]["uuid"], "00000000:00:06.0"
    )
    assert gpu.memory_total_bytes == 85520809984 and gpu.numa_node == 0
    assert gpu.cpu_affinity == tuple(range(16))
    assert gpu.nvlinks == () and gpu.unavailable_map["nvlinks"] == "Not Supported"
    # NVML answered the fabric query with an all-zero cluster UUID: not registered, so no clique.
    assert gpu.fabric_cluster_uuid is None and "fabric" in gpu.unavailable_map
    assert node.gpu_matrix == (("X",),)
    assert (node.driver_version, node.cuda_driver_version) == ("580.159.04", 13000)


# The hand-written fixtures against machines no one here wrote (tests/fixtures/smi/README.md): what
# discovery makes of them must match what nvidia-smi printed on such a machine.


def _smi(name: str) -> NodeProbe:
    from hybridshard.topology.smi import read_topo_matrix

    return read_topo_matrix(str(Path(__file__).parent / "fixtures" / "smi" / f"{name}.txt"))


def test_hand_written_gb200_tray_matches_a_real_gb200_tray(tmp_path):
    node, real = fixture_node("gb200_nvl72_node", tmp_path), _smi("gb200_x4_nv18")  # NVIDIA/k8s-test-infra#371
    assert node.gpu_matrix == real.gpu_matrix
    assert [(g.numa_node, g.cpu_affinity) for g in node.gpus] == [(g.numa_node, g.cpu_affinity) for g in real.gpus]


def test_hand_written_dgx_h100_matches_public_h100_matrices(tmp_path):
    """vllm-project/vllm#6746 and bytedance/flux#14 (8 x H100 80GB HBM3): NV18 between every pair, GPUs
    4-7 on NUMA node 1 with CPUs 56-111,168-223 (the part of their matrices the sources show in full)."""
    node = fixture_node("dgx_h100_nvswitch", tmp_path)
    assert node.gpu_matrix == tuple(tuple("X" if i == j else "NV18" for j in range(8)) for i in range(8))
    upper = tuple([*range(56, 112), *range(168, 224)])
    assert [(g.numa_node, g.cpu_affinity) for g in node.gpus[4:]] == [(1, upper)] * 4


@pytest.mark.parametrize("name", FIXTURE_NAMES)
def test_node_and_rank_probe_round_trip(name, tmp_path):
    node = fixture_node(name, tmp_path)
    assert NodeProbe.from_dict(json.loads(json.dumps(node.to_dict()))) == node
    rank = probe_rank(nvml=fake(name), env={"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}, sysfs_root=tmp_path)
    assert RankProbe.from_dict(json.loads(json.dumps(rank.to_dict()))) == rank


# -- failure is data ---------------------------------------------------------------------------


def test_fabric_query_failing_keeps_every_other_fact(tmp_path):
    good = fixture_node("gb200_nvl72_node", tmp_path)
    bad = fixture_node("gb200_nvl72_node", tmp_path, fabric_info="Not Supported")
    for g_good, g_bad in zip(good.gpus, bad.gpus):
        assert g_bad.fabric_cluster_uuid is None and g_bad.fabric_clique_id is None
        assert g_bad.unavailable_map == {"fabric": "Not Supported"}
        strip = lambda d: {k: v for k, v in d.items() if not k.startswith("fabric") and k != "unavailable"}
        assert strip(g_bad.to_dict()) == strip(g_good.to_dict())
    # Without the clique nothing ties the GPUs together: the matrix falls back to PCIe levels.
    assert bad.gpu_matrix[0][1] == "NODE" and bad.gpu_matrix[0][2] == "SYS"


def test_one_device_failing_one_query(tmp_path):
    node = fixture_node("dgx_h100_nvswitch", tmp_path, **{"cpu_affinity:2": "Unknown Error", "uuid:5": "GPU is lost"})
    assert node.gpus[2].cpu_affinity == () and node.gpus[2].unavailable_map["cpu_affinity"] == "Unknown Error"
    assert node.gpus[5].uuid is None and node.gpus[5].unavailable_map["uuid"] == "GPU is lost"
    assert node.gpus[3].cpu_affinity and node.gpus[2].numa_node == 0 and node.gpus[5].name


def test_common_ancestor_failing_leaves_nvlink_codes(tmp_path):
    node = fixture_node("pcie_nvlink_pairs", tmp_path, common_ancestor="Not Supported")
    assert node.gpu_matrix[0][1] == "NV12" and node.gpu_matrix[0][2] == "?"
    assert "Not Supported" in node.unavailable_map["gpu_matrix"]


@pytest.mark.parametrize("reason", ["Driver Not Loaded", "Insufficient Permissions"])
def test_init_failure_is_a_cpu_node(reason, tmp_path):
    node = fixture_node("dgx_h100_nvswitch", tmp_path, init=reason)
    assert node.gpus == () and node.unavailable_map["gpus"] == reason and node.numa_nodes


def test_device_count_failure_and_zero_gpus(tmp_path):
    node = fixture_node("dgx_h100_nvswitch", tmp_path, device_count="Unknown Error")
    assert node.gpus == () and node.unavailable_map["gpus"] == "Unknown Error" and node.driver_version == "550.54.15"
    empty = load("dgx_h100_nvswitch")
    empty["devices"], empty["topology"] = [], []
    node = probe_node(FakeNvml(empty), sysfs_root=tmp_path)
    assert node.gpus == () and node.unavailable_map["gpus"] == "NVML reports no GPUs"


def test_gpu_numa_falls_back_to_sysfs_then_cpu_affinity(tmp_path):
    root = fake_sysfs(tmp_path / "sys", HOST_NUMA["dgx_h100_nvswitch"], pci_numa={"0000:1b:00.0": 1})
    node = probe_node(fake("dgx_h100_nvswitch", memory_affinity="Not Supported"), sysfs_root=root)
    # GPU 0: the kernel's PCI numa_node (deliberately 1 here, to show it is the source).
    assert node.gpus[0].numa_node == 1
    # The others have no sysfs entry: their CPU affinity lies inside one NUMA node.
    assert [g.numa_node for g in node.gpus[1:]] == [0, 0, 0, 1, 1, 1, 1]
    # With neither, the NUMA node is unavailable, with every reason.
    node = probe_node(fake("dgx_h100_nvswitch", memory_affinity="Not Supported"), sysfs_root=tmp_path / "empty")
    assert node.gpus[0].numa_node is None
    reason = node.gpus[0].unavailable_map["numa_node"]
    assert "memory affinity: Not Supported" in reason and "not inside one NUMA node" in reason


def test_fake_nvml_rejects_unknown_format():
    with pytest.raises(ValueError, match="hybridshard-nvml/1"):
        FakeNvml({"format": "something-else"})


def test_recorder_cli_on_this_machine(tmp_path):
    out = tmp_path / "rec.json"
    proc = subprocess.run(
        [sys.executable, "-m", "hybridshard.topology.nvml", "record", "-o", str(out), "--description", "this host"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(out.read_text())
    assert data["format"] == "hybridshard-nvml/1" and data["description"] == "this host"
    # Either NVML works here and the devices were recorded, or the reason it does not is.
    assert bool(data["init_error"]) != isinstance(data.get("devices"), list)
    node = probe_node(FakeNvml(data), sysfs_root=tmp_path)
    assert node.num_gpus == len(data.get("devices") or [])


def test_pci_and_mask_helpers():
    assert normalize_pci_bus_id("0000:1b:00.0") == "00000000:1B:00.0"
    assert normalize_pci_bus_id(b"00000008:01:00.0\x00") == "00000008:01:00.0"
    assert normalize_pci_bus_id("00000000:00:00.0") is None and normalize_pci_bus_id(None) is None
    assert bits_from_words(["0x5", "0x1"]) == (0, 2, 64) and bits_from_words([0, 2**63]) == (127,)
    assert parse_cpu_list("0-3,8, 10-11\n") == (0, 1, 2, 3, 8, 10, 11) and parse_cpu_list("") == ()


# -- sysfs -------------------------------------------------------------------------------------


def _stats(isup=True, speed=0, mtu=1500, flags="up,broadcast,running"):
    return SimpleNamespace(isup=isup, speed=speed, mtu=mtu, flags=flags)


def test_sysfs_numa_sockets_and_nics(tmp_path):
    root = fake_sysfs(
        tmp_path,
        {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]},
        ib={
            "mlx5_0": {"netdevs": ["ib0"], "numa": 0},
            "mlx5_1": {"numa": 1, "state": "1: DOWN"},
            "mlx5_2": {"netdevs": ["ens3f0np0"], "link_layer": "Ethernet", "rate": "200 Gb/sec (2X HDR)", "numa": 1},
        },
        net_numa={"ens3f0np0": 1, "eth0": -1},
    )
    nodes, reason = probe_numa(root)
    assert reason is None and [(n.id, n.cpus, n.memory_bytes) for n in nodes] == [
        (0, (0, 1, 4, 5), 2**30),
        (1, (2, 3, 6, 7), 2**31),
    ]
    assert count_sockets(root) == 2
    stats = {
        "lo": _stats(mtu=65536, flags="up,loopback,running"),
        "eth0": _stats(speed=25000, mtu=9000),
        "ib0": _stats(speed=0, mtu=4092),
        "ens3f0np0": _stats(speed=200000),
    }
    nics = {n.name: n for n in probe_nics(root, stats)}
    assert set(nics) == {"eth0", "ib0", "ens3f0np0", "mlx5_1"}  # loopback out; IB HCA without netdev in
    assert (nics["eth0"].speed_mbps, nics["eth0"].is_rdma, nics["eth0"].numa_node, nics["eth0"].mtu) == (
        25000,
        False,
        None,
        9000,
    )
    ib0 = nics["ib0"]
    assert (ib0.is_rdma, ib0.rdma_device, ib0.link_layer, ib0.speed_mbps) == (True, "mlx5_0", "InfiniBand", 400000)
    roce = nics["ens3f0np0"]
    assert (roce.rdma_device, roce.link_layer, roce.numa_node, roce.speed_mbps) == ("mlx5_2", "Ethernet", 1, 200000)
    hca = nics["mlx5_1"]
    assert (hca.is_rdma, hca.is_up, hca.numa_node) == (True, False, 1)


def test_sysfs_missing_is_recorded(tmp_path):
    node = probe_node(fake("no_nvml"), sysfs_root=tmp_path / "nothing")
    assert node.numa_nodes == () and "no NUMA nodes" in node.unavailable_map["numa_nodes"]
    assert node.cpu_sockets is None and "cpu_sockets" in node.unavailable_map


def test_node_name_from_env_or_machine(tmp_path):
    assert node_name({"HYBRIDSHARD_NODE_NAME": "rack3-tray7"}) == "rack3-tray7"
    assert node_name({}) == machine_identity() == node_name({"HYBRIDSHARD_NODE_NAME": "  "})
    boot, mid = tmp_path / "boot_id", tmp_path / "machine-id"
    boot.write_text("213270bf-2dc6-4eff-9e3f-11f5b6a0019e\n")
    mid.write_text("3d1219c7c4c5404aaa1f6d2a48adfda4\n")
    assert machine_identity(str(boot), str(mid)) == "machine-213270bf-3d1219c7"
    assert machine_identity(str(boot), str(tmp_path / "none")) == "machine-213270bf"  # no machine id: boot id alone
    assert machine_identity(str(tmp_path / "none"), str(mid)) == "machine-3d1219c7"
    assert machine_identity(str(tmp_path / "none"), str(tmp_path / "none")) == socket.gethostname()


# -- CUDA_VISIBLE_DEVICES ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def dgx_gpus(tmp_path_factory):
    return fixture_node("dgx_h100_nvswitch", tmp_path_factory.mktemp("dgx")).gpus


def test_visible_devices_mapping(dgx_gpus):
    u = [g.uuid for g in dgx_gpus]
    assert resolve_visible_devices(None, dgx_gpus) == (tuple(u), ())
    assert resolve_visible_devices("", dgx_gpus) == ((), ())
    assert resolve_visible_devices("3,1", dgx_gpus) == ((u[3], u[1]), ())
    assert resolve_visible_devices(f"{u[6]}, {u[2][:12]}", dgx_gpus) == ((u[6], u[2]), ())
    assert resolve_visible_devices(f"MIG-{u[4]}/1/0", dgx_gpus) == ((u[4],), ())


@pytest.mark.parametrize(
    "value, expect, problem",
    [
        ("0,1,-1,2", 2, "'-1' is not a GPU ordinal"),
        ("8", 0, "it has 8 GPUs"),
        ("1,1", 1, "repeats"),
        ("GPU-", 0, "ambiguous"),
        ("GPU-ffffffff-0000", 0, "names no GPU"),
        ("MIG-0123abcd", 0, "names no MIG instance"),
        ("cuda0,1", 0, "neither an ordinal"),
    ],
)
def test_visible_devices_stop_at_first_bad_entry(dgx_gpus, value, expect, problem):
    visible, problems = resolve_visible_devices(value, dgx_gpus)
    assert len(visible) == expect and len(problems) == 1 and problem in problems[0]


def test_mig_instances_map_to_their_gpu(tmp_path):
    data = load("pcie_nvlink_pairs")
    data["devices"][3]["mig_devices"] = [
        "MIG-4d7c1e63-5c0e-5a55-9e4a-0c8d2f1b7a10",
        "MIG-91b2c3d4-0000-5111-8222-333344445555",
    ]
    env = {"CUDA_VISIBLE_DEVICES": "MIG-91b2c3d4", "LOCAL_RANK": "0"}
    probe = probe_rank(nvml=FakeNvml(data), env=env, sysfs_root=tmp_path)
    assert probe.gpu_uuid == data["devices"][3]["uuid"] and probe.visible_gpu_uuids == (probe.gpu_uuid,)


def test_probe_rank_picks_visible_device_by_local_rank(tmp_path):
    data = load("dgx_h100_nvswitch")
    u = [d["uuid"] for d in data["devices"]]
    env = {"RANK": "9", "LOCAL_RANK": "1", "WORLD_SIZE": "16", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    probe = probe_rank(nvml=FakeNvml(data), env=env, sysfs_root=tmp_path)
    assert (probe.rank, probe.local_rank, probe.world_size) == (9, 1, 16)
    assert probe.visible_gpu_uuids == tuple(u[4:]) and probe.gpu_uuid == u[5]
    assert probe.cuda_visible_devices == "4,5,6,7" and probe.cpu_affinity == tuple(sorted(os.sched_getaffinity(0)))
    # Reordered UUIDs: CUDA ordinal 0 is the first listed; local rank 3 wraps onto a single device.
    env = {"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": f"{u[7]},{u[0]}"}
    assert probe_rank(nvml=FakeNvml(data), env=env, sysfs_root=tmp_path).gpu_uuid == u[7]
    env = {"LOCAL_RANK": "3", "CUDA_VISIBLE_DEVICES": "2"}
    assert probe_rank(nvml=FakeNvml(data), env=env, sysfs_root=tmp_path).gpu_uuid == u[2]
    # Defaults: a lone process; no GPUs without NVML.
    lone = probe_rank(nvml=fake("no_nvml"), env={}, sysfs_root=tmp_path)
    assert (lone.rank, lone.local_rank, lone.world_size, lone.gpu_uuid, lone.visible_gpu_uuids) == (0, 0, 1, None, ())


def test_gpu_without_uuid_keeps_its_cuda_ordinal(tmp_path):
    # GPU 1's UUID query fails: ordinals must still count it, or every later one lands one GPU off.
    data = load("dgx_h100_nvswitch")
    u = [d["uuid"] for d in data["devices"]]
    nvml = lambda: FakeNvml(data, fail={"uuid:1": "Unknown Error"})  # noqa: E731
    for env, index in (({"LOCAL_RANK": "2"}, 2), ({"LOCAL_RANK": "0", "CUDA_VISIBLE_DEVICES": "2"}, 2),
                       ({"LOCAL_RANK": "1", "CUDA_VISIBLE_DEVICES": "0,3"}, 3)):
        probe = probe_rank(nvml=nvml(), env=env, sysfs_root=tmp_path)
        assert probe.gpu_uuid == u[index], env
    gone = probe_rank(nvml=nvml(), env={"LOCAL_RANK": "1"}, sysfs_root=tmp_path)
    assert gone.gpu_uuid is None and gone.visible_gpu_uuids == (u[0], None, *u[2:])
    visible, problems = resolve_visible_devices("1,2", gone.node.gpus)
    assert visible == (None, u[2]) and len(problems) == 1 and "GPU 1, whose UUID NVML did not report" in problems[0]


@pytest.mark.parametrize(
    "kwargs, env, match",
    [
        ({}, {"RANK": "one"}, "RANK must be an integer"),
        ({"rank": 4, "world_size": 4}, {}, "0 <= rank < world_size"),
        ({"local_rank": -1}, {}, "local_rank >= 0"),
        ({"world_size": 0, "rank": 0}, {}, "0 <= rank < world_size"),
    ],
)
def test_probe_rank_rejects_bad_placement(kwargs, env, match, tmp_path):
    with pytest.raises(ValueError, match=match):
        probe_rank(nvml=fake("no_nvml"), env=env, sysfs_root=tmp_path, **kwargs)


def test_fake_nvml_is_an_nvml_source():
    # The probe only relies on the interface; the fake must implement all of it.
    assert isinstance(fake("no_nvml"), NvmlSource)
    import hybridshard.topology.nvml as nvml

    assert nvml.FakeNvml is FakeNvml and nvml.record is record  # also importable from hybridshard.topology.nvml
    with pytest.raises(AttributeError):
        nvml.NoSuchThing  # noqa: B018
    data = copy.deepcopy(load("gb200_nvl72_node"))
    src = FakeNvml(data)
    src.init()
    assert src.fabric_info(0)["clique_id"] == 32766 and src.nvlink_remote_pci_bus_id(0, 0) is None


def test_mixed_models_without_pci_bus_order_are_reported():
    from hybridshard.topology.records import GpuInfo
    from hybridshard.topology.visible import ordinal_order_problem

    mixed = [GpuInfo(index=0, name="NVIDIA A100"), GpuInfo(index=1, name="NVIDIA T4")]
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in ordinal_order_problem(None, mixed, None)
    assert ordinal_order_problem("1,0", mixed, "FASTEST_FIRST") is not None
    assert ordinal_order_problem("1,0", mixed, "PCI_BUS_ID") is None
    assert ordinal_order_problem("GPU-aaaa,GPU-bbbb", mixed, None) is None  # UUIDs are never ambiguous
    assert ordinal_order_problem(None, mixed[:1] * 2, None) is None  # one model: both orders agree


def test_gpus_on_a_numa_node_without_rdma_nic_are_a_finding(tmp_path):
    from hybridshard.topology.findings import node_findings

    root = fake_sysfs(tmp_path / "sys", HOST_NUMA["dgx_h100_nvswitch"], ib={"mlx5_0": {"numa": 0}})
    node = probe_node(fake("dgx_h100_nvswitch"), sysfs_root=root, env={"HYBRIDSHARD_NODE_NAME": "n"})
    (finding,) = node_findings(node)
    assert finding.code == "nic_far"
    assert "GPU 4 on NUMA node 1, NICs on [0]" in finding.message and "GPU 3" not in finding.message
    both = fake_sysfs(tmp_path / "sys2", HOST_NUMA["dgx_h100_nvswitch"],
                      ib={"mlx5_0": {"numa": 0}, "mlx5_1": {"numa": 1}})
    assert node_findings(probe_node(fake("dgx_h100_nvswitch"), sysfs_root=both, env={})) == []
