"""`hybridshard topo`: local mode in a subprocess, cluster mode on 4 gloo ranks as 2 simulated nodes."""

from __future__ import annotations

import argparse
import io
import json
import re
import os
import socket
import subprocess
import sys
import types
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from hybridshard.cli import topo
from tests.mp import RankPool, node_placement
from hybridshard.topology.probe import machine_identity, probe_node

REPO = Path(__file__).resolve().parents[1]
JOB_VARS = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "SLURM_PROCID",
    "SLURM_NTASKS",
    "SLURM_LOCALID",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    topo.add_parser(parser.add_subparsers())
    return parser.parse_args(["topo", *argv])


def run_captured(*argv: str) -> tuple[int, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = topo.run(parse(*argv))
    return code, out.getvalue()


def topo_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if k not in JOB_VARS and k != "HYBRIDSHARD_NODE_NAME"}
    return subprocess.run(
        [sys.executable, "-m", "hybridshard", "topo", *argv],
        cwd=REPO,
        env={**clean, **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def no_job_env(monkeypatch):
    for var in JOB_VARS:
        monkeypatch.delenv(var, raising=False)


# -- local mode --------------------------------------------------------------------------------


def test_topo_json_names_this_host():
    proc = topo_cli("--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["node_name"] == machine_identity() == report["machine"]  # one machine, one node
    assert report["hostname"] == socket.gethostname()
    assert report["cpu_cores_logical"] == os.cpu_count()


def test_topo_json_uses_node_name_override():
    proc = topo_cli("--json", env={"HYBRIDSHARD_NODE_NAME": "sim-node-7"})
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    assert report["node_name"] == "sim-node-7" and report["hostname"] == socket.gethostname()


def test_topo_text_reports_gpus_or_says_there_are_none():
    proc = topo_cli()
    assert proc.returncode == 0, proc.stderr
    probe = probe_node()
    assert f"node {machine_identity()} (hostname {socket.gethostname()})" in proc.stdout and "NUMA nodes:" in proc.stdout and "NICs:" in proc.stdout
    if probe.gpus:
        assert f"GPUs: {probe.num_gpus}" in proc.stdout and "Connections (like nvidia-smi topo -m):" in proc.stdout
    else:
        assert f"no GPUs: {probe.unavailable_map['gpus']}" in proc.stdout


def test_usage_errors(no_job_env, capsys):
    assert topo.run(parse("--bandwidth")) == topo.EXIT_USAGE
    assert "--bandwidth measures between ranks" in capsys.readouterr().err
    assert topo.run(parse("--sizes", "1M")) == topo.EXIT_USAGE
    assert "add --bandwidth" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse("--bandwidth", "--sizes", "lots")
    assert "expected a positive size" in capsys.readouterr().err


@pytest.mark.parametrize(
    "text, expect", [("4096", 4096), ("64K", 65536), ("1M", 2**20), ("1GiB", 2**30), ("1.5m", 3 * 2**19)]
)
def test_parse_size(text, expect):
    assert topo.parse_size(text) == expect


@pytest.mark.parametrize("text", ["0", "-1M", "abc", "", "M"])
def test_parse_size_rejects(text):
    with pytest.raises(argparse.ArgumentTypeError, match="expected a positive size"):
        topo.parse_size(text)


def test_cluster_mode_environment_faults(no_job_env, monkeypatch, capsys):
    monkeypatch.setenv("RANK", "zero")
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert topo.run(parse()) == topo.EXIT_USAGE
    assert "must be integers" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "0")  # MASTER_ADDR/MASTER_PORT missing: fails at once, no hang
    assert topo.run(parse("--backend", "gloo", "--timeout", "10")) == topo.EXIT_USAGE
    err = capsys.readouterr().err
    assert "could not start the gloo process group" in err and "MASTER_ADDR" in err


def test_single_process_cluster_with_bandwidth(no_job_env, monkeypatch):
    """--cluster outside a job is a one-rank cluster; --bandwidth output is wired into text and JSON."""
    calls = []

    class Result:
        warnings = ["replicate group 0: 1.0 GB/s is below 10% of the shard group's"]

        def table(self):
            return "bandwidth table: all_gather 42.0 GB/s"

        def to_dict(self):
            return {"all_gather": [42.0]}

    def measure_bandwidth(groups, *, sizes_bytes=(2**20,), progress=False):
        calls.append((groups.plan.shard_groups, tuple(sizes_bytes), progress))
        return Result()

    fake = types.ModuleType("hybridshard.diagnostics.bandwidth")
    fake.measure_bandwidth = measure_bandwidth
    monkeypatch.setitem(sys.modules, "hybridshard.diagnostics.bandwidth", fake)
    monkeypatch.setenv("HYBRIDSHARD_NODE_NAME", "solo")

    code, out = run_captured("--cluster", "--json", "--bandwidth", "--sizes", "1M", "4M")
    report = json.loads(out)
    assert code == 0 and report["num_nodes"] == 1 and report["plan"]["shard_groups"] == [[0]]
    assert report["bandwidth"] == {"all_gather": [42.0]}
    assert [w["code"] for w in report["warnings"]] == ["bandwidth"]
    assert calls == [(((0,),), (2**20, 4 * 2**20), True)]
    code, out = run_captured("--cluster", "--bandwidth")
    assert (
        code == 0 and "bandwidth table: all_gather 42.0 GB/s" in out and "[warning] bandwidth: replicate group 0" in out
    )


# -- cluster mode on 4 ranks -------------------------------------------------------------------


def topo_on_rank(placement, argv):
    """Act as the rank of ``placement`` (node name, local rank) and run the topo command in-process."""
    import torch.distributed as dist

    node, local_rank = placement[dist.get_rank()]
    os.environ["HYBRIDSHARD_NODE_NAME"] = node
    os.environ["LOCAL_RANK"] = str(local_rank)
    return run_captured(*argv)


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, num_nodes=2, layout="block") as p:
        yield p


@pytest.mark.multiprocess
@pytest.mark.parametrize("layout, shard_groups", [("block", [[0, 1], [2, 3]]), ("cyclic", [[0, 2], [1, 3]])])
def test_cluster_json_groups_follow_nodes(pool, layout, shard_groups):
    results = pool.run(topo_on_rank, node_placement(4, 2, layout), ["--json"])
    assert [code for code, _ in results] == [0] * 4
    assert all(out == "" for _, out in results[1:])  # only rank 0 prints
    report = json.loads(results[0][1])
    assert report["num_nodes"] == 2 and report["world_size"] == 4 and report["ok"] is True
    nodes = {n["name"]: [r["rank"] for r in n["ranks"]] for n in report["cluster"]["nodes"]}
    assert sorted(nodes.values()) == shard_groups
    assert report["plan"]["shard_groups"] == shard_groups
    assert report["plan"]["replicate_groups"] == [list(g) for g in zip(*shard_groups)]
    codes = [w["code"] for w in report["warnings"]]
    assert codes == ([] if layout == "block" else ["non_contiguous_ranks"])


@pytest.mark.multiprocess
def test_cluster_errors_exit_non_zero_on_every_rank(pool):
    results = pool.run(topo_on_rank, node_placement(4, 2, "block"), ["--shard-size", "3"])
    assert [code for code, _ in results] == [topo.EXIT_FINDINGS] * 4
    text = results[0][1]
    assert "cluster: 2 node(s), world size 4" in text
    assert re.search(rf"node0  {re.escape(socket.gethostname())} +machine-\S+ +0-1 \(2\)", text), text
    assert "plan: none" in text and "[error] plan_failed: no group plan: shard_size=3 does not tile" in text


@pytest.mark.multiprocess
def test_cluster_bandwidth_measures_the_planned_groups(pool):
    results = pool.run(topo_on_rank, node_placement(4, 2, "block"), ["--json", "--bandwidth", "--sizes", "64K"])
    assert [code for code, _ in results] == [0] * 4
    report = json.loads(results[0][1])
    rows = report["bandwidth"]["rows"]
    measured = {(r["kind"], tuple(r["ranks"])) for r in rows}
    assert measured == {
        ("all_gather", (0, 1)),
        ("all_gather", (2, 3)),
        ("reduce_scatter", (0, 1)),
        ("reduce_scatter", (2, 3)),
        ("all_reduce", (0, 2)),
        ("all_reduce", (1, 3)),
    }
    assert all(r["size_bytes"] == 65536 for r in rows)
    text_results = pool.run(topo_on_rank, node_placement(4, 2, "block"), ["--bandwidth", "--sizes", "64K"])
    assert "busbw (GB/s)" in text_results[0][1] and "plan: world size 4" in text_results[0][1]
