"""`hybridshard plan`: plans of synthetic and saved clusters, and its errors."""

from __future__ import annotations

import json

from hybridshard.cli import main
from hybridshard.topology.synthetic import synthetic_cluster


def test_plan_text_for_cyclic_cluster(capsys):
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "4", "--layout", "cyclic"]) == 0
    out = capsys.readouterr().out
    assert "2 replicas x shard size 4" in out
    assert "0, 2, 4, 6  [node0]" in out and "1, 3, 5, 7  [node1]" in out


def test_plan_json_nvlink_pairs(capsys):
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "8", "--nvlink", "pairs", "--domain", "nvlink", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["shard_size"] == 2 and plan["replicate_size"] == 8
    assert plan["shard_groups"][0] == [0, 1]


def test_plan_from_saved_cluster(tmp_path, capsys):
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": synthetic_cluster(3, [8, 4, 8]).to_dict()}))
    assert main(["plan", "--from", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["shard_size"] == 4


def test_plan_errors_exit_non_zero_with_reason(tmp_path, capsys):
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "4", "--shard-size", "3"]) == 2
    assert "shard_size=3 does not tile" in capsys.readouterr().err
    assert main(["plan", "--nodes", "3", "--gpus-per-node", "8", "4"]) == 2
    assert "one count or one per node (3)" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{\"hello\": 1}")
    assert main(["plan", "--from", str(bad)]) == 2
    assert "expected a cluster view" in capsys.readouterr().err
    assert main(["plan", "--from", str(tmp_path / "missing.json")]) == 2
    assert "expected a readable JSON cluster view" in capsys.readouterr().err


def test_plan_output_cut_short_by_the_reader_is_not_an_error(tmp_path):
    import subprocess
    import sys

    # `| head -1`: the reader closes the pipe after one line; the command must not print a traceback.
    # 2048 nodes as JSON is far more than a pipe buffer, so the write after `head` exits must fail.
    cmd = f"{sys.executable} -m hybridshard plan --nodes 2048 --gpus-per-node 8 --json | head -1"
    done = subprocess.run(["bash", "-o", "pipefail", "-c", cmd], capture_output=True, text=True, timeout=60)
    assert done.stdout == "{\n"
    assert "Traceback" not in done.stderr and done.returncode == 0, done.stderr


def test_plan_single_replica_wording(capsys):
    assert main(["plan", "--nodes", "1", "--gpus-per-node", "2"]) == 0
    assert "world size 2 = 1 replica x shard size 2" in capsys.readouterr().out
