"""`launch/local-cluster`: real hosts in network namespaces, shaping, and cleanup on every exit path."""

import glob
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest

from hybridshard.launcher import local_cluster, netns
from hybridshard.launcher.local_cluster import ClusterOptions, host_env, launch_argv
from hybridshard.launcher.netns import LocalNetwork, Shaping, check_rights, list_own_objects, run_tag

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_CLUSTER = os.path.join(REPO, "launch", "local-cluster")
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")

NO_RIGHTS = check_rights()  # the one check of this machine's rights, for the whole module
if NO_RIGHTS:
    print(f"\nlocal-cluster tests skipped: {NO_RIGHTS}", file=sys.stderr)
needs_netns = pytest.mark.skipif(NO_RIGHTS is not None, reason=f"cannot create network namespaces: {NO_RIGHTS}")


def start(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env["PYTHONPATH"] = REPO
    return subprocess.Popen([sys.executable, LOCAL_CLUSTER, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc, timeout=150):
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err


def assert_nothing_left(pid):
    left = list_own_objects(run_tag(pid) + "-")
    assert left == {"netns": [], "links": [], "etc": []}, left


def host_output(out, host):
    """What ``host``'s rank 0 printed: its lines, ``[host] [rank<R>] `` prefixes removed."""
    prefix = f"[{host}] "
    lines = (line[len(prefix):] for line in out.splitlines() if line.startswith(prefix))
    return "\n".join(re.sub(r"^\[rank\d+\] ", "", line) for line in lines)


def json_of(text):
    return json.loads(text[text.index("\n{") + 1 if not text.startswith("{") else 0:])


def rank0_stdout(tmp_path):
    """Rank 0's stdout, from its log in the run directory (on the console its stderr lines, teed apart,
    may come in between)."""
    [path] = glob.glob(str(tmp_path / "hybridshard-logs" / "run-*" / "node0" / "*" / "attempt_0" / "0" / "stdout.log"))
    with open(path) as f:
        return f.read()


# -- without namespaces --------------------------------------------------------------------------

def test_options_and_shaping_are_validated():
    for kw, fragment in (({"num_nodes": 0}, "--nodes"), ({"procs_per_node": 0}, "--procs-per-node"),
                         ({"command": ()}, "no command"), ({"timeout_s": -1.0}, "--timeout")):
        base = dict(num_nodes=2, procs_per_node=1, command=("x",))
        base.update(kw)
        with pytest.raises(ValueError, match=fragment):
            ClusterOptions(**base)
    with pytest.raises(ValueError, match="not a tc rate"):
        Shaping(rate="fast")
    with pytest.raises(ValueError, match="not a tc time"):
        Shaping(latency="200")
    with pytest.raises(ValueError, match="--nodes must be"):
        LocalNetwork(0)


def test_host_command_and_environment():
    opts = ClusterOptions(num_nodes=3, procs_per_node=2, command=("train.py", "--x"), port=1234)
    argv = launch_argv(opts, 2, "host0", python="py")
    assert argv == ["py", "-m", "hybridshard", "launch", "--nnodes", "3", "--node-rank", "2", "--nproc-per-node",
                    "2", "--master-addr", "host0", "--master-port", "1234", "--", "train.py", "--x"]
    env = host_env({"RANK": "3", "SLURM_JOB_ID": "1", "HYBRIDSHARD_NODE_NAME": "n", "KEEP": "1"})
    assert "RANK" not in env and "SLURM_JOB_ID" not in env and "HYBRIDSHARD_NODE_NAME" not in env
    assert env["KEEP"] == "1" and env["GLOO_SOCKET_IFNAME"] == netns.IFNAME
    net = LocalNetwork(2, tag="hslctest")
    assert [h.address for h in net.hosts] == [f"{netns.SUBNET}.1", f"{netns.SUBNET}.2"]
    assert net.host_argv(net.hosts[1], ["cmd"])[:4] == ["ip", "netns", "exec", "hslctest-n1"]


def test_clear_message_without_rights(monkeypatch, capsys):
    monkeypatch.setattr(local_cluster, "check_rights", lambda: "`ip netns add` failed: Operation not permitted")
    rc = local_cluster.run_cluster(ClusterOptions(num_nodes=2, procs_per_node=1, command=("true",)))
    err = capsys.readouterr().err
    assert rc == local_cluster.RIGHTS_EXIT
    assert "cannot create network namespaces" in err and "Operation not permitted" in err and "root" in err


def test_check_option_reports_rights(monkeypatch, capsys):
    monkeypatch.setattr(local_cluster, "check_rights", lambda: "`ip netns add` failed: Operation not permitted")
    assert local_cluster.main(["--check"]) == local_cluster.RIGHTS_EXIT
    assert "cannot create network namespaces here: `ip netns add` failed" in capsys.readouterr().out
    monkeypatch.setattr(local_cluster, "check_rights", lambda: None)
    assert local_cluster.main(["--check"]) == 0
    assert "can be created here" in capsys.readouterr().out


def test_rights_check_names_a_missing_tool(monkeypatch):
    monkeypatch.setattr(netns.shutil, "which", lambda name: None if name == "unshare" else "/usr/bin/" + name)
    assert "`unshare` is not installed" in check_rights()


# -- with namespaces ----------------------------------------------------------------------------

@needs_netns
def test_two_hosts_report_two_nodes_and_same_host_shard_groups(tmp_path):
    proc = start(["--nodes", "2", "--procs-per-node", "2", "--timeout", "120", "--",
                  "python", "-m", "hybridshard", "topo", "--cluster", "--json"], tmp_path)
    rc, out, err = finish(proc)
    assert rc == 0, out + err
    report = json_of(rank0_stdout(tmp_path))
    nodes = {n["name"]: sorted(r["rank"] for r in n["ranks"]) for n in report["cluster"]["nodes"]}
    assert nodes == {"host0": [0, 1], "host1": [2, 3]}
    assert sorted(map(sorted, report["plan"]["shard_groups"])) == [[0, 1], [2, 3]]
    assert sorted(map(sorted, report["plan"]["replicate_groups"])) == [[0, 2], [1, 3]]
    assert_nothing_left(proc.pid)


@needs_netns
def test_shaped_inter_node_link_is_far_slower(tmp_path):
    proc = start(["--nodes", "2", "--procs-per-node", "2", "--inter-node-bandwidth", "20mbit", "--timeout", "120",
                  "--", "python", "-m", "hybridshard", "topo", "--cluster", "--json", "--bandwidth",
                  "--sizes", "1048576"], tmp_path)
    rc, out, err = finish(proc)
    assert rc == 0, out + err
    rows = json_of(rank0_stdout(tmp_path))["bandwidth"]["rows"]
    shard = sorted(r["busbw_gbps"] for r in rows if r["kind"] in ("all_gather", "reduce_scatter"))
    replicate = [r["busbw_gbps"] for r in rows if r["kind"] == "all_reduce"]
    assert len(shard) == 4 and len(replicate) == 2
    # 20 mbit is 0.0025 GB/s per direction: the shaped link bounds the replicate groups, while the shard
    # groups run on loopback inside a host. The median shard row keeps one row slowed by the two shared
    # CPU cores from deciding the comparison.
    assert max(replicate) < 0.0025 * 1.5, replicate
    median_shard = (shard[1] + shard[2]) / 2
    assert max(replicate) * 10 < median_shard, (shard, replicate)
    assert_nothing_left(proc.pid)


@needs_netns
def test_example_job_matches_single_process_reference(tmp_path):
    proc = start(["--nodes", "2", "--procs-per-node", "2", "--timeout", "150", "--",
                  EXAMPLE, "--steps", "4", "--json-out", str(tmp_path / "dist.json")], tmp_path)
    rc, out, err = finish(proc, timeout=200)
    assert rc == 0, out + err
    ref = subprocess.run([sys.executable, EXAMPLE, "--reference", "--steps", "4", "--json-out",
                          str(tmp_path / "ref.json")], env=dict(os.environ, PYTHONPATH=REPO),
                         capture_output=True, text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    dist_run, ref_run = (json.loads((tmp_path / n).read_text()) for n in ("dist.json", "ref.json"))
    assert dist_run["world_size"] == 4 and ref_run["world_size"] == 1
    assert dist_run["losses"] == pytest.approx(ref_run["losses"], rel=1e-5)
    assert dist_run["losses"][-1] < dist_run["losses"][0]
    assert dist_run["checksum"] == pytest.approx(ref_run["checksum"], rel=1e-5)
    assert "tokens/s" in host_output(out, "host0")
    assert_nothing_left(proc.pid)


@needs_netns
def test_failing_command_returns_its_status_and_leaves_nothing(tmp_path):
    proc = start(["--nodes", "2", "--procs-per-node", "1", "--timeout", "60", "--", "python", "-c",
                  "import socket, sys; sys.exit(3 if socket.gethostname() == 'host1' else 0)"], tmp_path)
    rc, out, err = finish(proc)
    assert rc != 0
    assert "host1 failed" in out
    assert_nothing_left(proc.pid)


@needs_netns
def test_timeout_and_interrupt_leave_nothing(tmp_path):
    proc = start(["--nodes", "2", "--procs-per-node", "1", "--timeout", "6", "--", "python", "-c",
                  "import time; time.sleep(120)"], tmp_path)
    rc, out, _ = finish(proc)
    assert rc == local_cluster.TIMEOUT_EXIT and "timed out" in out
    assert_nothing_left(proc.pid)

    proc = start(["--nodes", "2", "--procs-per-node", "1", "--", "python", "-c", "import time; time.sleep(120)"],
                 tmp_path)
    deadline = time.monotonic() + 60
    while not list_own_objects(run_tag(proc.pid) + "-")["netns"] and time.monotonic() < deadline:
        time.sleep(0.2)
    time.sleep(2)  # let the hosts start their programs
    proc.send_signal(signal.SIGINT)
    rc, out, _ = finish(proc, timeout=60)
    assert rc == local_cluster.INTERRUPT_EXIT and "interrupted" in out
    assert_nothing_left(proc.pid)


def test_tc_failure_names_the_option():
    with pytest.raises(RuntimeError, match="cannot apply --latency"):
        netns._run_tc(["tc", "qdisc", "add", "dev", "hslc-no-such-dev", "root", "netem", "delay", "1ms"], "--latency")
