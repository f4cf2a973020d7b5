"""`nvidia-smi topo -m` from real machines (tests/fixtures/smi, sources in its README): each source's
stated facts, the NVLink islands and the plans `plan --from-smi --nodes 2` makes, and the one-line
errors for text that is not one whole matrix."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hybridshard.cli import main
from hybridshard.topology.findings import node_findings
from hybridshard.topology.islands import find_islands
from hybridshard.topology.planner import plan_groups
from hybridshard.topology.smi import nearest_nics, parse_topo_matrix, read_topo_matrix
from hybridshard.topology.synthetic import replicated_cluster

SMI = Path(__file__).parent / "fixtures" / "smi"


def node(name: str):
    return read_topo_matrix(str(SMI / f"{name}.txt"))


def nv_pairs(probe) -> dict[tuple[int, int], str]:
    m = probe.gpu_matrix
    return {(i, j): m[i][j] for i in range(len(m)) for j in range(i + 1, len(m)) if m[i][j].startswith("NV")}


def cpus(text: str) -> tuple[int, ...]:
    out = []
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        out += range(int(lo), int(hi or lo) + 1)
    return tuple(out)


def plan(probe, domain: str, **kw):
    return [list(g) for g in plan_groups(replicated_cluster(probe, 2), domain=domain, **kw).shard_groups]


FIRST_EIGHT, SECOND_EIGHT = list(range(8)), list(range(8, 16))


# -- facts each source states ------------------------------------------------------------------


def test_dgx1_hybrid_cube_mesh():
    """DGX-1 (V100): NV1/NV2 cube-mesh, two sockets, four mlx5 NICs, no NUMA column."""
    p = node("dgx1_v100_cube_mesh")
    assert p.num_gpus == 8
    assert nv_pairs(p) == {
        (0, 1): "NV1", (0, 2): "NV1", (0, 3): "NV2", (0, 4): "NV2", (1, 2): "NV2", (1, 3): "NV1", (1, 5): "NV2",
        (2, 3): "NV2", (2, 6): "NV1", (3, 7): "NV1", (4, 5): "NV1", (4, 6): "NV1", (4, 7): "NV2", (5, 6): "NV2",
        (5, 7): "NV1", (6, 7): "NV2",
    }
    assert p.gpu_matrix[0][5] == p.gpu_matrix[3][4] == "SYS"
    assert [g.cpu_affinity for g in p.gpus] == [cpus("0-19,40-59")] * 4 + [cpus("20-39,60-79")] * 4
    assert all(g.numa_node is None and g.unavailable_map["numa_node"].startswith("no NUMA Affinity column") for g in p.gpus)
    assert [n.name for n in p.nics] == ["mlx5_0", "mlx5_2", "mlx5_1", "mlx5_3"]
    assert [nearest_nics(p, i) for i in range(8)] == [
        (("mlx5_0",), "PIX")] * 2 + [(("mlx5_1",), "PIX")] * 2 + [(("mlx5_2",), "PIX")] * 2 + [(("mlx5_3",), "PIX")] * 2
    # GPU 0 has no NVLink to 5, 6, 7, yet 0-1-5-4-7-6-2-3-0 is all NVLink: one island.
    assert find_islands(p).islands == (tuple(range(8)),) and find_islands(p).notes == ()
    assert plan(p, "node") == plan(p, "nvlink") == [FIRST_EIGHT, SECOND_EIGHT]
    assert plan(p, "nvlink", shard_size=4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    with pytest.raises(ValueError, match="needs each rank's NUMA node"):
        plan(p, "numa")


def test_h100x4_one_numa_node_per_gpu_in_odd_order():
    p = node("h100x4_nv6_numa_per_gpu")
    assert p.num_gpus == 4 and set(nv_pairs(p).values()) == {"NV6"} and len(nv_pairs(p)) == 6
    assert [g.numa_node for g in p.gpus] == [3, 1, 7, 5]
    assert [g.cpu_affinity for g in p.gpus] == [(6, 14, 22, 30), (4, 12, 20, 28), (7, 15, 23, 31), (5, 13, 21, 29)]
    assert [n.name for n in p.nics] == ["NIC0", "NIC1", "NIC2", "NIC3"] and "no NIC Legend" in p.unavailable_map["nics"]
    assert [nearest_nics(p, i) for i in range(4)] == [((f"NIC{i}",), "PIX") for i in range(4)]
    assert [n.numa_node for n in p.nics] == [3, 1, 7, 5]
    assert find_islands(p).islands == ((0, 1, 2, 3),)
    assert plan(p, "node") == plan(p, "nvlink") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan(p, "numa") == [[r] for r in range(8)]  # a NUMA node per GPU: nothing to shard inside one


def test_gb200_tray_nv18_two_numa_nodes():
    p = node("gb200_x4_nv18")
    assert p.num_gpus == 4 and set(nv_pairs(p).values()) == {"NV18"} and len(nv_pairs(p)) == 6
    assert [g.numa_node for g in p.gpus] == [0, 0, 1, 1]
    assert [g.cpu_affinity for g in p.gpus] == [cpus("0-71")] * 2 + [cpus("72-143")] * 2
    assert p.nics == ()
    assert plan(p, "node") == plan(p, "nvlink") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert plan(p, "numa") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_rtx4090x8_pcie_only_nics_near_one_gpu():
    p = node("rtx4090x8_pcie_sys")
    assert p.num_gpus == 8 and nv_pairs(p) == {}
    assert {p.gpu_matrix[i][j] for i in range(8) for j in range(8) if i != j} == {"SYS"}
    assert [g.numa_node for g in p.gpus] == [0] * 4 + [1] * 4
    assert [g.cpu_affinity for g in p.gpus] == [cpus("0-55,112-167")] * 4 + [cpus("56-111,168-223")] * 4
    assert nearest_nics(p, 6) == (("NIC0", "NIC1"), "PHB") and nearest_nics(p, 0) == (("NIC0", "NIC1"), "SYS")
    assert find_islands(p).islands == tuple((i,) for i in range(8))
    far = [f for f in node_findings(p) if f.code == "nic_far"]
    assert len(far) == 1 and "GPU 0 reaches" in far[0].message and "GPU 6" not in far[0].message
    assert plan(p, "node") == [FIRST_EIGHT, SECOND_EIGHT]
    assert plan(p, "nvlink") == [[r] for r in range(16)]
    assert plan(p, "numa") == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]


def test_five_gpus_one_on_the_other_socket():
    p = node("mixed5_phb_node_sys")
    assert p.num_gpus == 5 and nv_pairs(p) == {}
    assert p.gpu_matrix[1][2] == p.gpu_matrix[3][4] == "PHB" and p.gpu_matrix[1][3] == "NODE"
    assert {p.gpu_matrix[0][j] for j in range(1, 5)} == {"SYS"}
    assert [g.numa_node for g in p.gpus] == [1, 0, 0, 0, 0]
    assert p.gpus[0].cpu_affinity == cpus("8-15,24-31") and p.gpus[4].cpu_affinity == cpus("0-7,16-23")
    assert plan(p, "node") == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9]]
    assert find_islands(p).islands == tuple((i,) for i in range(5))
    assert plan(p, "nvlink") == [[r] for r in range(10)]
    with pytest.raises(ValueError, match="no shard size above 1 tiles every numa domain"):
        plan(p, "numa")


def test_two_sockets_numa_affinity_na():
    p = node("rtx3090x2_sys_numa_na")
    assert p.gpu_matrix == (("X", "SYS"), ("SYS", "X"))
    assert p.gpus[0].numa_node is None and p.gpus[0].unavailable_map["numa_node"] == "NUMA Affinity is N/A"
    assert p.gpus[1].numa_node == 1
    assert p.gpus[0].cpu_affinity == cpus("0-7,16-23") and p.gpus[1].cpu_affinity == cpus("8-15,24-31")
    assert plan(p, "node") == [[0, 1], [2, 3]] and plan(p, "nvlink") == [[0], [1], [2], [3]]
    with pytest.raises(ValueError, match="rank 0 .* has neither a GPU with a known NUMA node"):
        plan(p, "numa")


def test_underlined_header_of_a_recent_driver_reads():
    """Recorded on a single-H100 machine: the header line carries terminal underline codes."""
    text = (SMI / "h100x1_single_gpu_ansi.txt").read_text()
    assert "\x1b[4m" in text.splitlines()[0]
    p = read_topo_matrix(str(SMI / "h100x1_single_gpu_ansi.txt"))
    assert p.num_gpus == 1 and p.gpus[0].numa_node == 0 and p.gpus[0].cpu_affinity == tuple(range(16))
    assert p.gpus[0].nvlinks == ()


def test_reindented_paste_still_reads():
    p = node("rtx3090x2_node_reindented")
    assert p.gpu_matrix == (("X", "NODE"), ("NODE", "X"))
    assert [(g.numa_node, g.cpu_affinity) for g in p.gpus] == [(0, cpus("0-15"))] * 2
    assert plan(p, "numa") == plan(p, "node") == [[0, 1], [2, 3]]
    assert plan(p, "nvlink") == [[0], [1], [2], [3]]


def test_pcie_switches_old_driver_without_numa_column():
    p = node("pcie_switch8_old_driver")
    m = p.gpu_matrix
    assert [m[0][1], m[2][3], m[4][5], m[6][7]] == ["PIX"] * 4 and m[0][2] == m[5][7] == "PXB" and m[3][4] == "SYS"
    assert [g.cpu_affinity for g in p.gpus] == [cpus("0-13")] * 4 + [cpus("14-27")] * 4
    assert [nearest_nics(p, i)[1] for i in range(8)] == ["SYS"] * 4 + ["PHB"] * 4
    far = [f for f in node_findings(p) if f.code == "nic_far"]
    assert len(far) == 1 and "GPU 3 reaches" in far[0].message and "GPU 4" not in far[0].message
    assert plan(p, "node") == [FIRST_EIGHT, SECOND_EIGHT] and plan(p, "nvlink") == [[r] for r in range(16)]
    with pytest.raises(ValueError, match="needs each rank's NUMA node"):
        plan(p, "numa")  # no NUMA column, and the CPU lists are not NUMA nodes: not guessed


# -- the same report, plan and binding through the commands ---------------------------------------


@pytest.mark.parametrize("name", sorted(f.stem for f in SMI.glob("*.txt")))
def test_commands_read_every_fixture(name, capsys):
    path = str(SMI / f"{name}.txt")
    assert main(["topo", "--from-smi", path]) == 0
    out = capsys.readouterr().out
    assert f"node {name}" in out and "NVLink islands:" in out and "Connections" in out
    assert main(["plan", "--from-smi", path, "--nodes", "2", "--domain", "node", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["replicate_size"] == 2
    assert main(["launch", "--dry-run", "--from-smi", path, "train.py"]) == 0
    out = capsys.readouterr().out
    num_gpus = read_topo_matrix(path).num_gpus
    assert f"# local ranks on {name}:" in out and f"--nproc-per-node {num_gpus}" in out


def test_launch_dry_run_shows_binding_and_nearest_nic(capsys):
    path = str(SMI / "h100x4_nv6_numa_per_gpu.txt")
    assert main(["launch", "--dry-run", "--bind-numa", "--from-smi", path, "train.py"]) == 0
    out = capsys.readouterr().out
    assert "2           GPU2  7     7,15,23,31 (NUMA node 7)  NIC2 (PIX)" in out
    assert "HYBRIDSHARD_CPU_BINDING=6,14,22,30;4,12,20,28;7,15,23,31;5,13,21,29" in out
    assert main(["launch", "--from-smi", path, "train.py"]) == 2
    assert "it needs --dry-run" in capsys.readouterr().err


def test_plan_from_smi_sizes_a_model_with_the_given_memory(capsys):
    path = str(SMI / "h100x4_nv6_numa_per_gpu.txt")
    assert main(["plan", "--from-smi", path, "--nodes", "2", "--model-params", "7B"]) == 2
    assert "needs --gpu-memory" in capsys.readouterr().err
    assert main(["plan", "--from-smi", path, "--nodes", "2", "--model-params", "7B", "--gpu-memory", "80GB"]) == 0
    assert "cluster: 2 nodes x 4 GPUs = 8 ranks; 80.0 GB per GPU" in capsys.readouterr().out


def test_topo_from_smi_json_and_bad_file(tmp_path, capsys):
    assert main(["topo", "--from-smi", str(SMI / "rtx4090x8_pcie_sys.txt"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["nics"][0]["gpu_levels"][6] == "PHB" and [w["code"] for w in report["warnings"]] == ["nic_far"]
    bad = tmp_path / "bad.txt"
    bad.write_text("hello\n")
    assert main(["topo", "--from-smi", str(bad)]) == 2
    assert "line 1: expected the header" in capsys.readouterr().err


# -- the parser: what it accepts and what it refuses --------------------------------------------

# Hand-written (not from a machine): small shapes that no fixture has.
LEGEND = """\tGPU0\tGPU1\tNIC0\tCPU Affinity\tNUMA Affinity\tGPU NUMA ID
GPU0\t X \tNV4\tNODE\t\t0\t\tN/A
GPU1\tNV4\t X \tPIX\t\t0\t\tN/A
NIC0\tNODE\tPIX\t X 

Legend:

  X    = Self

NIC Legend:

  NIC0: mlx5_0
"""


def test_nic_legend_names_and_blank_cpu_affinity():
    p = parse_topo_matrix(LEGEND)
    assert [n.name for n in p.nics] == ["mlx5_0"] and nearest_nics(p, 1) == (("mlx5_0",), "PIX")
    assert all(g.cpu_affinity == () and g.numa_node == 0 for g in p.gpus)
    assert p.gpus[0].unavailable_map["cpu_affinity"] == "CPU Affinity is blank"


def test_a_chain_is_not_an_island_and_no_group_hides_a_pcie_hop():
    chain = "\n".join([
        "      GPU0  GPU1  GPU2  GPU3",
        "GPU0   X    NV2   SYS   SYS",
        "GPU1  NV2    X    NV2   SYS",
        "GPU2  SYS   NV2    X    NV2",
        "GPU3  SYS   SYS   NV2    X",
    ])
    p = parse_topo_matrix(chain)
    islands = find_islands(p)
    assert islands.islands == ((0, 1), (2, 3)) and "no NVLink ring runs through all of them" in islands.notes[0]
    assert [f.code for f in node_findings(p)] == ["nvlink_island"]
    assert plan(p, "nvlink") == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_ring_check_refuses_a_slice_without_ring():
    # Hand-written: the 4-cycle 0-2-1-3-0 is one island, but cut in halves it gives the PCIe pairs {0,1}, {2,3}.
    square = "\n".join([
        "      GPU0  GPU1  GPU2  GPU3",
        "GPU0   X    SYS   NV1   NV1",
        "GPU1  SYS    X    NV1   NV1",
        "GPU2  NV1   NV1    X    SYS",
        "GPU3  NV1   NV1   SYS    X",
    ])
    p = parse_topo_matrix(square)
    assert find_islands(p).islands == ((0, 1, 2, 3),)
    assert plan(p, "nvlink") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with pytest.raises(ValueError, match=r"shard size 2 puts a PCIe hop .* ranks \[0, 1\] .* \(\[1, 4\]\)"):
        plan(p, "nvlink", shard_size=2)


WHOLE = (SMI / "h100x4_nv6_numa_per_gpu.txt").read_text()


@pytest.mark.parametrize(
    "text, line, what",
    [
        ("Tue Jan 1\n+-----+\n| NVIDIA-SMI 535 |\n", 1, "expected the header"),
        ("\n".join(WHOLE.splitlines()[:4]), 5, "expected the row of GPU3"),  # truncated after GPU2
        ("\n".join(WHOLE.splitlines()[:7]), 8, "expected the row of NIC2"),  # NIC rows cut off
        (WHOLE.replace("GPU1    NV6      X      NV6     NV6     SYS", "GPU1    NV6      X      NV6     SYS", 1), 3,
         "expected 8 levels"),  # one cell lost: the row is short
        (WHOLE.replace("GPU2    NV6     NV6      X      NV6 ", "GPU2    NV6     NV6      X      SYS ", 1), 5,
         "not symmetric"),
        (WHOLE.replace("GPU1    NV6      X ", "GPU1     X      NV6", 1), 3, "expected X where row GPU1"),
        (WHOLE.replace("6,14,22,30      3", "6,14,22,30   3   3", 1), 2, "expected at most 3 cells"),
        (WHOLE.replace("GPU3    NV6", "GPU4    NV6", 1), 5, "expected the row of GPU3"),
    ],
    ids=["not-a-matrix", "truncated", "nic-rows-missing", "short-row", "asymmetric", "diagonal", "extra-cell",
         "wrong-label"],
)
def test_bad_text_is_a_one_line_error_naming_the_line(text, line, what):
    with pytest.raises(ValueError) as err:
        parse_topo_matrix(text)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"line {line}: ") and what in message, message


# The Fabric section as `nvidia-smi -q` prints it (its layout as public tools parse it); values hand-written.
def query(*fabrics: tuple[str, str, str, str]) -> str:
    out = []
    for k, (state, status, clique, uuid) in enumerate(fabrics):
        out += [f"GPU 00000009:{k:02X}:00.0", "    Product Name                          : NVIDIA GB200",
                "    Fabric", f"        State                             : {state}",
                f"        Status                            : {status}",
                f"        CliqueId                          : {clique}",
                f"        ClusterUUID                       : {uuid}",
                "        Health", "            Bandwidth                     : Full",
                "    Processes                             : None", ""]
    return "\n".join(out)


RACK = "6c3f10a2-1b4e-4b8e-9a57-0d2f3c4b5a69"


def test_fabric_section_makes_a_clique_span_nodes(tmp_path, capsys):
    tray = node("gb200_x4_nv18")
    from hybridshard.topology.smi import apply_fabric

    racked = apply_fabric(tray, query(*[("Completed", "Success", "32766", RACK)] * 4))
    assert {(g.fabric_cluster_uuid, g.fabric_clique_id) for g in racked.gpus} == {(RACK, 32766)}
    # Every copy reports the same clique: one NVLink domain across both nodes.
    assert plan(racked, "nvlink") == [list(range(8))]
    assert plan(tray, "nvlink") == [[0, 1, 2, 3], [4, 5, 6, 7]]
    alone = apply_fabric(tray, query(*[("In Progress", "N/A", "N/A", "N/A")] * 4))
    assert alone.gpus[0].fabric_cluster_uuid is None and "In Progress" in alone.gpus[0].unavailable_map["fabric"]
    with pytest.raises(ValueError, match=r"^line 3: expected one Fabric section per GPU \(4\), found 1"):
        apply_fabric(tray, query(("Completed", "Success", "1", RACK)))
    q = tmp_path / "q.txt"
    q.write_text(query(*[("Completed", "Success", "7", RACK)] * 4))
    path = str(SMI / "gb200_x4_nv18.txt")
    assert main(["plan", "--from-smi", path, "--smi-query", str(q), "--nodes", "2", "--domain", "nvlink", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shard_groups"] == [list(range(8))]


def test_a_gpu_whose_nvlinks_fail_is_its_own_island_and_said_so(tmp_path):
    """NVML discovery (hand-written HGX H100 fixture) with GPU 2's NVLink queries failing: the report
    names it, and an NVLink plan cannot hide it inside a group."""
    from hybridshard.topology.nvml_recorded import FakeNvml
    from hybridshard.topology.probe import probe_node
    from hybridshard.topology.report import render_node

    nvml = FakeNvml.from_file(Path(__file__).parent / "fixtures" / "nvml" / "dgx_h100_nvswitch.json",
                              fail={"nvlink_state:2": "Unknown Error"})
    probe = probe_node(nvml, sysfs_root=tmp_path, env={"HYBRIDSHARD_NODE_NAME": "hgx"})
    assert find_islands(probe).islands == ((0, 1, 3, 4, 5, 6, 7), (2,))
    (finding,) = node_findings(probe)
    assert finding.code == "nvlink_island" and "GPU 2 has no NVLink to any other GPU" in finding.message
    assert "NVLink islands: {0,1,3,4,5,6,7} {2}" in render_node(probe)
    with pytest.raises(ValueError, match="no shard size above 1 tiles every nvlink domain"):
        plan(probe, "nvlink")


def test_uneven_island_is_a_finding():
    # Hand-written: GPU 2 joined by NV12 where the others have NV18.
    rows = [["X" if i == j else ("NV12" if 2 in (i, j) else "NV18") for j in range(4)] for i in range(4)]
    text = "      GPU0  GPU1  GPU2  GPU3\n" + "\n".join(f"GPU{i}  " + "  ".join(r) for i, r in enumerate(rows))
    notes = find_islands(parse_topo_matrix(text)).notes
    assert notes == ("uneven NVLink island {0,1,2,3}: GPU 2 has 36 NVLinks to it, the others 48; "
                     "the weakest GPU sets the pace of its rings",)
