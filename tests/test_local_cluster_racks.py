"""`launch/local-cluster --racks`: racks joined by a shaped spine, its counters, and a spine cut mid-job
reported by every rank as a network partition."""

import glob
import json
import os
import subprocess
import sys
import time

import pytest

from hybridshard.launcher import local_cluster, netns
from hybridshard.launcher.local_cluster import ClusterOptions
from hybridshard.launcher.netns import LocalNetwork, Shaping, check_rights, list_own_objects, run_tag
from hybridshard.launcher.spine import Spine
from hybridshard.launcher.spine_run import COUNTERS_FILE, SpineCut, read_counters
from hybridshard.runtime.faults import partition
from hybridshard.runtime.faults.rank_state import ControlPlane, bound

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LOCAL_CLUSTER = os.path.join(REPO, "launch", "local-cluster")
JOB = os.path.join(REPO, "tests", "spine_job.py")

NO_RIGHTS = check_rights()
if NO_RIGHTS:
    print(f"\nlocal-cluster rack tests skipped: {NO_RIGHTS}", file=sys.stderr)
needs_netns = pytest.mark.skipif(NO_RIGHTS is not None, reason=f"cannot create network namespaces: {NO_RIGHTS}")

# A receiver that counts the bytes of one connection, and a sender of a given number of bytes; both
# bounded in time (the socket timeouts) and in bytes.
RECEIVE = ("import socket,time;s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1);"
           "s.bind(('0.0.0.0',5001));s.listen(1);s.settimeout(20);c,_=s.accept();c.settimeout(20);n=0;t=time.time()\n"
           "while True:\n d=c.recv(65536)\n if not d: break\n n+=len(d)\nprint(n,time.time()-t)")
SEND = ("import socket,sys;s=socket.create_connection((sys.argv[1],5001),timeout=10);"
        "s.sendall(b'x'*int(sys.argv[2]));s.close()")


# -- without namespaces --------------------------------------------------------------------------

def test_racks_options_are_validated():
    with pytest.raises(ValueError, match=r"^expected --nodes to be a multiple of --racks, found --nodes 3 --racks 2"):
        ClusterOptions(num_nodes=3, procs_per_node=1, command=("x",), racks=2)
    with pytest.raises(ValueError, match=r"^expected --racks with"):
        ClusterOptions(num_nodes=2, procs_per_node=1, command=("x",), spine=Shaping(rate="1gbit"))
    with pytest.raises(ValueError, match=r"^expected --racks with"):
        LocalNetwork(2, spine=Shaping(rate="1gbit"))
    with pytest.raises(ValueError, match=r"^expected --racks >= 1"):
        LocalNetwork(2, racks=0)
    with pytest.raises(ValueError, match="found both"):
        SpineCut(after_s=1.0, when="x")
    with pytest.raises(ValueError, match="found neither"):
        SpineCut()
    with pytest.raises(ValueError, match="regular expression"):
        SpineCut(when="(")


def test_cli_errors_name_the_spine_options(capsys):
    assert local_cluster.main(["--nodes", "3", "--racks", "2", "--", "true"]) == 2
    assert "expected --nodes to be a multiple of --racks" in capsys.readouterr().err
    assert local_cluster.main(["--nodes", "2", "--racks", "2", "--spine-rate", "fast", "--", "true"]) == 2
    assert "--spine-rate 'fast' is not a tc rate" in capsys.readouterr().err


def test_hosts_are_split_into_contiguous_racks():
    net = LocalNetwork(6, racks=3, tag="hslctest")
    assert [h.network_path for h in net.hosts] == ["pod0/rack0"] * 2 + ["pod0/rack1"] * 2 + ["pod0/rack2"] * 2
    assert [r.hosts for r in net.spine.racks] == [(0, 1), (2, 3), (4, 5)]
    names = [net.spine.bridge] + [n for r in net.spine.racks for n in (r.bridge, r.uplink, r.uplink_spine)]
    assert all(n.startswith("hslctest-") and len(n) <= 15 for n in names)  # found by remove_leftovers, IFNAMSIZ
    assert [netns._BRIDGE_RE.search(n) is not None for n in ("x-br", "x-b12", "x-v1", "x-u0", "x-s0")] == \
        [True, True, False, False, False]
    assert LocalNetwork(2, tag="hslctest").spine is None and LocalNetwork(2, tag="hslctest").hosts[0].network_path is None


def test_spine_counters_are_read_per_rack():
    spine = Spine("hslctest", 4, 2)
    fake = {"hslctest-u0/statistics/tx_bytes": 10, "hslctest-u0/statistics/rx_bytes": 20,
            "hslctest-u1/statistics/tx_bytes": 30, "hslctest-u1/statistics/rx_bytes": 40}
    read = lambda path: fake[path.split("/sys/class/net/")[1]]  # noqa: E731
    assert spine.bytes(read) == {0: (10, 20), 1: (30, 40)}


def _plane_with_paths(known):
    plane = ControlPlane()
    plane.found["paths"] = known
    return plane


def test_lost_ranks_of_whole_racks_read_as_a_partition(monkeypatch):
    known = partition.parse_paths(b"0=pod0/rack0\n1=pod0/rack0\n2=pod0/rack1\n3=pod0/rack1\n4=pod0/rack2\n5=pod0/rack2\n")
    monkeypatch.setenv(partition.ENV, "pod0/rack0")
    with bound(_plane_with_paths(known)):
        assert partition.lost_racks_text(0, {2, 3}) == (
            "network partition: racks [pod0/rack1] unreachable from pod0/rack0 (ranks [2, 3]): the link between "
            "them (spine) is down, or every host of that rack went down at once")
        assert "racks [pod0/rack1, pod0/rack2] unreachable" in partition.lost_racks_text(0, {2, 3, 4, 5})
        assert partition.lost_racks_text(0, {2}) is None  # one host of a rack: the lost ranks' message
        assert partition.lost_racks_text(0, {1, 2, 3}) is None  # not whole racks
        assert partition.store_lost_text(0) is None  # the store's rack
        monkeypatch.setenv(partition.ENV, "pod0/rack1")
        assert partition.store_lost_text(2).startswith(
            "network partition: racks [pod0/rack0] unreachable from pod0/rack1 (rank 2 lost the job's store")
        assert partition.lost_racks_text(2, {2, 3}) is None  # its own rack
    with bound(_plane_with_paths({})):  # cut before it learned the store's rack
        assert partition.store_lost_text(2) is None
        assert "the job's store (host0:29500, with rank 0; its rack not learned yet) unreachable from pod0/rack1" in \
            partition.store_lost_text(2, ("host0", 29500))
    monkeypatch.delenv(partition.ENV)
    with bound(_plane_with_paths(known)):
        assert partition.lost_racks_text(0, {2, 3}) is None and partition.store_lost_text(2) is None


# -- with namespaces ----------------------------------------------------------------------------

def _transfer(net, sender, receiver, numel):
    """``numel`` bytes from host ``sender`` to host ``receiver``; the spine's counters before and after."""
    before = net.spine_bytes()
    recv = subprocess.Popen(net.host_argv(net.hosts[receiver], [sys.executable, "-c", RECEIVE]),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    time.sleep(0.5)
    sent = subprocess.run(net.host_argv(net.hosts[sender], [sys.executable, "-c", SEND, net.hosts[receiver].name,
                                                            str(numel)]), capture_output=True, text=True, timeout=60)
    out, err = recv.communicate(timeout=60)
    assert sent.returncode == 0 and recv.returncode == 0, sent.stderr + err
    got, seconds = out.split()
    assert int(got) == numel
    after = net.spine_bytes()
    return {k: (after[k][0] - before[k][0], after[k][1] - before[k][1]) for k in after}, float(seconds)


@needs_netns
def test_spine_carries_only_traffic_between_racks():
    net = LocalNetwork(4, racks=2, spine=Shaping(rate="50mbit"))
    numel = 2_000_000
    try:
        net.up()
        inside, _ = _transfer(net, 0, 1, numel)
        across, _ = _transfer(net, 0, 2, numel)
        print(f"\nspine bytes, 2 MB host0->host1 (rack0): {inside}; host0->host2 (rack0->rack1): {across}")
        assert all(tx < 64_000 and rx < 64_000 for tx, rx in inside.values()), inside  # ARP, flooding only
        assert numel <= across[0][0] < 1.2 * numel and numel <= across[1][1] < 1.2 * numel, across
        net.set_spine_rate("5mbit")  # 1 MB at 5 mbit: 1.6 s, less what the 256 KB burst lets through
        _, seconds = _transfer(net, 3, 1, 1_000_000)
        print(f"1 MB rack1->rack0 at 5mbit: {seconds:.2f}s")
        assert seconds > 1.0, seconds
        net.cut_spine()
        cut = subprocess.run(net.host_argv(net.hosts[0], [sys.executable, "-c", SEND, "host2", "1000"]),
                             capture_output=True, text=True, timeout=30)
        assert cut.returncode != 0  # no route between racks
        _transfer(net, 0, 1, 100_000)  # inside a rack: still fine
        net.restore_spine()
        _transfer(net, 0, 2, 100_000)
    finally:
        assert net.teardown() == []
    assert list_own_objects(net.tag + "-") == {"netns": [], "links": [], "etc": []}


def _start(args, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HYBRIDSHARD_"))}
    env["PYTHONPATH"] = REPO
    return subprocess.Popen([sys.executable, LOCAL_CLUSTER, *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@needs_netns
def test_each_host_sees_its_rack_and_counters_are_logged(tmp_path):
    probe = f"import os,socket; open(os.path.join({str(tmp_path)!r}, socket.gethostname()), 'w').write(os.environ['HYBRIDSHARD_NETWORK_PATH'])"
    proc = _start(["--nodes", "4", "--racks", "2", "--spine-rate", "100mbit", "--procs-per-node", "1", "--timeout", "120",
                   "--log-dir", str(tmp_path / "run"), "--", "python", "-c", probe], tmp_path)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 0, out + err
    seen = {h: (tmp_path / h).read_text() for h in ("host0", "host1", "host2", "host3")}
    assert seen == {"host0": "pod0/rack0", "host1": "pod0/rack0", "host2": "pod0/rack1", "host3": "pod0/rack1"}
    lines = read_counters(str(tmp_path / "run" / COUNTERS_FILE))
    assert lines[0]["event"] == "start" and lines[-1]["event"] == "end"
    assert set(lines[-1]["racks"]) == {"pod0/rack0", "pod0/rack1"}
    assert "2 racks of 2 hosts joined by a spine" in out and "bytes over the spine: pod0/rack0 tx" in out
    assert list_own_objects(run_tag(proc.pid) + "-") == {"netns": [], "links": [], "etc": []}


def _rank_error(run_dir, node):
    [path] = glob.glob(os.path.join(run_dir, f"node{node}", "*", "attempt_0", "0", "error.json"))
    with open(path) as f:
        message = json.load(f)["message"]
    return message["message"], message["extraInfo"]["hybridshard"]["time"]


@needs_netns
def test_cut_spine_is_reported_as_a_partition_by_every_rank(tmp_path):
    run_dir = str(tmp_path / "run")
    started = time.monotonic()
    proc = _start(["--nodes", "2", "--racks", "2", "--procs-per-node", "1", "--timeout", "240", "--log-dir", run_dir,
                   "--cut-spine-when", r"step 10 ", "--", JOB, "--steps", "400"], tmp_path)
    out, err = proc.communicate(timeout=300)
    elapsed = time.monotonic() - started
    assert proc.returncode not in (0, local_cluster.TIMEOUT_EXIT), out + err
    assert "cut the spine (host0 printed a line matching 'step 10 ')" in out, out + err
    assert "bytes over the spine" in out, (proc.returncode, out + err)  # it ended on its own, counters read
    [cut] = [line["time"] for line in read_counters(os.path.join(run_dir, COUNTERS_FILE)) if line["event"] == "cut"]
    assert len(glob.glob(os.path.join(run_dir, "node*", "*", "attempt_0", "0", "error.json"))) == 2, out + err
    message0, time0 = _rank_error(run_dir, 0)
    message1, time1 = _rank_error(run_dir, 1)
    print(f"\npartition reported {time0 - cut:.1f}s (rank 0) and {time1 - cut:.1f}s (rank 1) after the cut; "
          f"the job ended {elapsed:.0f}s after its start")
    assert "network partition: racks [pod0/rack1] unreachable from pod0/rack0 (ranks [1])" in message0, message0
    assert "network partition: racks [pod0/rack0] unreachable from pod0/rack1 (rank 1 lost the job's store" in message1
    assert 0 < time0 - cut < 30 and 0 < time1 - cut < 30, (time0 - cut, time1 - cut)
    for node in (0, 1):
        [log] = glob.glob(os.path.join(run_dir, f"node{node}", "*", "attempt_0", "0", "stderr.log"))
        assert "network partition" in open(log).read()
    assert "network partition" in out  # the summary's root cause
    assert list_own_objects(run_tag(proc.pid) + "-") == {"netns": [], "links": [], "etc": []}
