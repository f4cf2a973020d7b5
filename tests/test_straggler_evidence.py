"""The straggler report's evidence: the job's NIC from the route to the store, a GPU's clocks and
clocks-event reasons from NVML, and fault-tolerant replica groups named as such (pure; faked
psutil, socket and NVML; no process group)."""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from collections import namedtuple

import pytest
import torch

from hybridshard.runtime.faults import gpu_state, stragglers
from hybridshard.runtime.faults.gpu_state import GpuReader, GpuState, decode_reasons, find_index
from hybridshard.runtime.faults.verdicts import PERSIST, GroupTime, RankSummary, Tracker, analyse
from hybridshard.topology import job_nic as J
from hybridshard.topology.nvml import FORMAT, NvmlQueryError
from hybridshard.topology.nvml_recorded import FakeNvml
from hybridshard.topology.records import NetInterface

Addr = namedtuple("Addr", "family address netmask broadcast ptp")
ADDRS = {"lo": [Addr(2, "127.0.0.1", None, None, None)],
         "eth0": [Addr(2, "192.168.1.7", None, None, None)],
         "eth1": [Addr(2, "10.0.0.2", None, None, None), Addr(10, "fe80::2%eth1", None, None, None)]}


# -- the job's NIC -------------------------------------------------------------------------------------

def test_nic_is_the_interface_routing_to_the_store():
    asked = []
    route = lambda host: asked.append(host) or "10.0.0.2"  # noqa: E731
    found = J.job_nic("10.0.0.1", env={"NCCL_SOCKET_IFNAME": "eth0"}, if_addrs=lambda: ADDRS, route=route)
    assert found == J.JobNic("eth1", "route to 10.0.0.1") and asked == ["10.0.0.1"]
    assert J.interface_of("fe80::2", ADDRS) == "eth1" and J.interface_of("10.9.9.9", ADDRS) is None


def test_nic_falls_back_to_the_socket_variables_then_the_probe():
    loopback = lambda host: "127.0.0.1"  # noqa: E731  (the store on this host: a fault-tolerant one-node job)
    nics = lambda: (NetInterface("eth0", is_up=True), NetInterface("eth9", is_up=False),  # noqa: E731
                    NetInterface("ib0", is_up=True, is_rdma=True))
    env = {"NCCL_SOCKET_IFNAME": "=ib1,ib2"}
    assert J.job_nic("localhost", env=env, if_addrs=lambda: ADDRS, route=loopback, nics=nics) == J.JobNic(
        "ib1", "NCCL_SOCKET_IFNAME")
    env = {"NCCL_SOCKET_IFNAME": "^docker,lo", "GLOO_SOCKET_IFNAME": "eth0"}  # an exclusion list names nothing
    assert J.job_nic(None, env=env, nics=nics) == J.JobNic("eth0", "GLOO_SOCKET_IFNAME")
    assert J.job_nic("nowhere", env={}, route=lambda host: None, nics=nics) == J.JobNic("ib0, eth0", "probe")

    def broken():
        raise OSError("no /sys")
    assert J.job_nic(None, env={}, nics=broken) == J.JobNic("", "")


def test_local_address_sends_nothing(monkeypatch):
    sent = []

    class FakeSocket:
        def __init__(self, *args):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def connect(self, address):
            self.peer = address

        def getsockname(self):
            return ("10.0.0.2", 40000)

        def sendto(self, *args):
            sent.append(args)

    monkeypatch.setattr(J.socket, "getaddrinfo", lambda host, port, type: [(2, 2, 17, "", ("10.0.0.1", 9))])
    monkeypatch.setattr(J.socket, "socket", FakeSocket)
    assert J.local_address("store-host") == "10.0.0.2" and sent == []
    monkeypatch.undo()
    assert J.local_address("127.0.0.1") == "127.0.0.1"  # the real kernel, on loopback
    assert J.local_address("no-such-host.invalid") is None


def test_nic_default_reads_psutil(monkeypatch):
    import psutil

    monkeypatch.setattr(psutil, "net_if_addrs", lambda: ADDRS)
    assert J.job_nic("10.0.0.1", env={}, route=lambda host: "10.0.0.2") == J.JobNic("eth1", "route to 10.0.0.1")


class DictStore:
    def __init__(self):
        self.kv = {}

    def set(self, key, value):
        self.kv[key] = value.encode() if isinstance(value, str) else value

    def check(self, keys):
        return all(k in self.kv for k in keys)

    def multi_get(self, keys):
        return [self.kv[k] for k in keys]


def _run_reporter(monkeypatch, steps: int, **env) -> tuple[stragglers.Reporter, list]:
    calls = []
    monkeypatch.setattr(stragglers, "job_nic", lambda host: calls.append(host) or J.JobNic("eth1", f"route to {host}"))
    for k, v in {"MASTER_ADDR": "10.0.0.1", **env}.items():
        monkeypatch.setenv(k, v)
    rep = stragglers.Reporter(5, 0, 1, DictStore())
    stragglers.CLOCK.start()
    try:
        for step in range(steps):
            rep.at_forward(step, None)
    finally:
        stragglers.CLOCK.stop()
    return rep, calls


def test_reporter_names_its_nic_once_at_start(monkeypatch):
    rep, calls = _run_reporter(monkeypatch, 23)
    assert calls == ["10.0.0.1"] and (rep.nic, rep.nic_source) == ("eth1", "route to 10.0.0.1")
    assert len(rep.reports) >= 2  # several reports, one look-up
    summary = RankSummary.from_json(json.loads(rep.store.kv[f"{rep.prefix}0/0"]))
    assert summary.nic == "eth1" and summary.gpu is None and summary.replica_group == ""  # a CPU rank


# -- a GPU's clocks and thermals -----------------------------------------------------------------------

def test_reasons_decode_to_words():
    assert decode_reasons(0x24) == ("power cap", "thermal slowdown")
    assert decode_reasons(0x1 | 0x40 | 0x800) == ("idle", "HW thermal slowdown", "reason 0x800")
    assert decode_reasons(0) == ()
    hot = GpuState(3, 1095, 1980, 87, ("idle", "thermal slowdown"))
    assert hot.slowing == ("thermal slowdown",) and hot.text() == "GPU 3 at 1,095 of 1,980 MHz, 87 C, thermal slowdown"
    assert hot.advice().startswith("check its cooling")
    assert GpuState(0, 1980, 1980, 60, ("idle",)).text().endswith("60 C, no clocks event")


def _stand_in_pynvml(event_reasons: bool):
    import pynvml as real

    m = types.ModuleType("pynvml")
    m.NVMLError, m.NVML_CLOCK_SM, m.NVML_TEMPERATURE_GPU = real.NVMLError, real.NVML_CLOCK_SM, real.NVML_TEMPERATURE_GPU
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetClockInfo = lambda h, kind: {real.NVML_CLOCK_SM: 1095}[kind]
    m.nvmlDeviceGetMaxClockInfo = lambda h, kind: {real.NVML_CLOCK_SM: 1980}[kind]

    def temperature(h, sensor):
        if h == 1:
            raise real.NVMLError(real.NVML_ERROR_NOT_SUPPORTED)
        return {real.NVML_TEMPERATURE_GPU: 87}[sensor]
    m.nvmlDeviceGetTemperature = temperature
    reasons = lambda h: 0x21  # noqa: E731
    if event_reasons:
        m.nvmlDeviceGetCurrentClocksEventReasons = reasons
    else:  # bindings older than NVML 12.2
        m.nvmlDeviceGetCurrentClocksThrottleReasons = reasons
    return m


@pytest.mark.parametrize("event_reasons", [True, False])
def test_pynvml_source_reads_clocks(monkeypatch, event_reasons):
    from hybridshard.topology.nvml import PynvmlSource

    monkeypatch.setitem(sys.modules, "pynvml", _stand_in_pynvml(event_reasons))
    source = PynvmlSource()
    source.init()
    assert source.clock_state(0) == {"sm_mhz": 1095, "sm_max_mhz": 1980, "temperature_c": 87, "reasons": 0x21}
    with pytest.raises(NvmlQueryError, match="clock_state: Not Supported"):
        source.clock_state(1)


def _nvml(clocks=None, **extra):
    device = lambda i, c: {"uuid": f"GPU-0000000{i}-1111-2222-3333-444444444444",  # noqa: E731
                           "pci_bus_id": f"00000000:{0x1B + i:02X}:00.0", **({"clocks": c} if c else {})}
    return {"format": FORMAT, "devices": [device(0, None), device(1, clocks)], **extra}


def test_reader_finds_its_gpu_by_uuid_and_reads_once_per_call(monkeypatch):
    monkeypatch.setattr(gpu_state, "cuda_identity", lambda device: ("00000001-1111-2222-3333-444444444444", None))
    reader = GpuReader(torch.device("cuda", 0), FakeNvml(_nvml({"sm_mhz": 1095, "sm_max_mhz": 1980,
                                                                  "temperature_c": 87, "reasons": 0x20})))
    assert reader.read() == GpuState(1, 1095, 1980, 87, ("thermal slowdown",)) and reader.index == 1
    fake = FakeNvml(_nvml())
    fake.init()
    assert find_index(fake, None, "0000:1b:00.0") == 0 and find_index(fake, "GPU-nope", None) is None


def test_reader_without_nvml_gives_no_reading_and_stops_asking(monkeypatch):
    monkeypatch.setattr(gpu_state, "cuda_identity", lambda device: ("00000001-1111-2222-3333-444444444444", None))
    inits = []

    class NoDriver(FakeNvml):
        def init(self):
            inits.append(1)
            super().init()
    reader = GpuReader(torch.device("cuda", 0), NoDriver(_nvml(init_error="Driver Not Loaded")))
    assert reader.read() is None and reader.read() is None
    assert inits == [1] and reader.unavailable == "Driver Not Loaded"
    no_clocks = GpuReader(torch.device("cuda", 0), FakeNvml(_nvml()))  # an old recording: no live reading
    assert no_clocks.read() is None and "clock_state" in no_clocks.unavailable


def _s(rank: int, node: str, compute: float = 0.010, step: float = 0.020, comm=None, gpu=None, group="") -> RankSummary:
    return RankSummary(rank, node, steps=20, step_s=step, compute_s=compute, comm=comm or {}, gpu=gpu,
                       replica_group=group)


def _job(compute=None, gpus=None, nodes=2, per_node=2, groups=None, step=0.020, comm=None) -> list[RankSummary]:
    compute, gpus, groups = compute or {}, gpus or {}, groups or {}
    return [_s(r, f"node{r // per_node}", compute.get(r, 0.010), step, comm(r) if comm else None, gpus.get(r),
               groups.get(r, "")) for r in range(nodes * per_node)]


def test_slow_rank_evidence_names_its_gpu_clocks():
    hot = GpuState(3, 1095, 1980, 87, ("thermal slowdown",))
    [v] = analyse(_job({3: 0.015}, {r: GpuState(r, 1980, 1980, 61) for r in range(3)} | {3: hot}))
    assert (v.kind, v.ranks) == ("rank", (3,))
    assert v.action.startswith("GPU 3 at 1,095 of 1,980 MHz, 87 C, thermal slowdown: check its cooling")
    assert "GPU 3 at 1,095 of 1,980 MHz" in v.text()
    [cool] = analyse(_job({3: 0.015}, {3: GpuState(3, 1980, 1980, 61, ("idle",))}))
    assert cool.action.startswith("GPU 3 at full clocks (61 C), no clocks event: not the GPU's clocks; rank 3's")
    [cpu] = analyse(_job({3: 0.015}))  # CPU ranks: the text as before
    assert cpu.action.startswith("rank 3's own work is slow")
    [node] = analyse(_job({2: 0.015, 3: 0.015}, {2: GpuState(2, 1980, 1980, 60), 3: GpuState(3, 1400, 1980, 70, ("power cap",))}))
    assert node.kind == "node" and node.action.startswith("GPU 3 at 1,400 of 1,980 MHz, 70 C, power cap: it runs at its power limit")


def test_summary_json_round_trip_and_old_lines():
    s = _s(3, "node1", gpu=GpuState(3, 1095, 1980, 87, ("power cap", "thermal slowdown")), group="replica1",
           comm={"all_gather@shard": GroupTime(0.002, (2, 3))})
    assert RankSummary.from_json(json.loads(json.dumps(s.to_json()))) == s
    old = {"rank": 1, "node": "n", "rack": "", "nic": "eth0", "steps": 4, "step_s": 0.02, "compute_s": 0.01, "comm": {}}
    assert RankSummary.from_json(old) == RankSummary(1, "n", "", "eth0", 4, 0.02, 0.01, {})


# -- fault-tolerant replica groups ---------------------------------------------------------------------

def _reports(tracker: Tracker, job, n: int):
    out = None
    for _ in range(n):
        out = tracker.update(job)
    return out


def test_a_replica_group_slow_as_a_whole_is_named_against_its_baseline():
    groups = {r: "replica1" for r in range(4)}
    tracker = Tracker()
    _reports(tracker, _job(groups=groups), 3)  # healthy: the baseline
    active, changes = _reports(tracker, _job({r: 0.016 for r in range(4)}, groups=groups, step=0.030), PERSIST)
    [v] = active
    assert (v.kind, v.subject, v.group, v.ranks, v.nodes) == (
        "replica_group", "replica group replica1", "compute", (0, 1, 2, 3), ("node0", "node1"))
    assert v.ratio == pytest.approx(1.6) and "1.60x the baseline (10.00 ms)" in changes[0]
    assert "the other groups go on without it" in v.action
    plain = Tracker()  # the same job without fault tolerance: a balanced slowdown
    _reports(plain, _job(), 3)
    assert [v.kind for v in _reports(plain, _job({r: 0.016 for r in range(4)}, step=0.030), PERSIST)[0]] == ["balanced"]


def test_a_replica_group_that_waits_points_at_the_others():
    groups = {r: "replica0" for r in range(4)}
    tracker = Tracker()
    _reports(tracker, _job(groups=groups), 3)
    [v], _ = _reports(tracker, _job(groups=groups, step=0.030), PERSIST)  # same compute, longer steps
    assert (v.kind, v.subject) == ("balanced", "every rank of replica group replica0")
    assert "all-reduce across replica groups" in v.action


def test_several_replica_groups_one_slow_is_named():
    groups = {r: f"replica{r // 4}" for r in range(12)}  # 3 groups of 2 nodes x 2 ranks
    found = analyse(_job({8: 0.016, 9: 0.015, 10: 0.016, 11: 0.017}, nodes=6, groups=groups))
    assert [(v.kind, v.subject, v.ranks, v.nodes) for v in found] == [
        ("replica_group", "replica group replica2", (8, 9, 10, 11), ("node4", "node5"))]
    assert found[0].ratio > 1.3 and "computes slowly" in found[0].action
    one_node = analyse(_job({10: 0.016, 11: 0.017}, nodes=6, groups=groups))  # half a group: its node
    assert [(v.kind, v.subject) for v in one_node] == [("node", "node5")]
    mixed = {**groups, 0: ""}  # a rank without an id: nothing renamed
    assert [v.kind for v in analyse(_job({8: 0.016, 9: 0.015, 10: 0.016, 11: 0.017}, nodes=6, groups=mixed))] == [
        "node", "node"]


def test_a_replica_group_whose_link_is_slow_is_named():
    pairs = {0: (0, 2), 2: (0, 2), 1: (1, 4), 4: (1, 4), 3: (3, 5), 5: (3, 5)}  # replicate pairs across 3 nodes

    def comm(slow):
        return lambda r: {"all_reduce@replicate": GroupTime(
            0.004 * (2.0 if slow in {f"node{m // 2}" for m in pairs[r]} else 1.0), pairs[r])}
    groups = {r: f"replica{r // 2}" for r in range(6)}  # each node its own replica group
    healthy = Tracker()
    _reports(healthy, _job(nodes=3, comm=comm(None), groups=groups), 3)
    [v] = analyse(_job(nodes=3, comm=comm("node2"), groups=groups), healthy.baselines())
    assert (v.kind, v.subject, v.group, v.ranks) == ("replica_group", "replica group replica2", "all_reduce@replicate", (4, 5))
    assert "transfers slowly (all_reduce@replicate)" in v.action


def test_set_replica_group_reaches_the_summaries(monkeypatch):
    monkeypatch.setattr(stragglers, "_REPLICA", [""])
    rep, _ = _run_reporter(monkeypatch, 8, HYBRIDSHARD_REPLICA_ID="replica3")
    assert rep.replica_group == "replica3"
    stragglers._REPORTER[:] = [rep]
    try:
        stragglers.set_replica_group("replica7")
    finally:
        stragglers._REPORTER.clear()
    assert rep.replica_group == "replica7" and stragglers._REPLICA == ["replica7"]
    assert stragglers.summarize(0, [stragglers.StepTimes(9, 0.02, 0.01)], {}, replica_group=rep.replica_group
                                ).replica_group == "replica7"


def test_reporter_puts_its_gpu_in_the_summary_and_the_record(monkeypatch):
    hot = GpuState(5, 1095, 1980, 87, ("thermal slowdown",))

    class Reader:
        reads = 0

        def __init__(self, device):
            pass

        def read(self):
            Reader.reads += 1
            return hot
    monkeypatch.setattr(stragglers, "GpuReader", Reader)
    monkeypatch.setattr(stragglers, "job_nic", lambda host: J.JobNic("", ""))
    rep = stragglers.Reporter(5, 0, 1, DictStore())
    stragglers.CLOCK.start()
    monkeypatch.setattr(stragglers.CLOCK, "at_forward", lambda step, device: None)  # no CUDA events here
    monkeypatch.setattr(stragglers.CLOCK, "take", lambda: [stragglers.StepTimes(s, 0.02, 0.01) for s in range(2, 5)])
    try:
        for step in range(16):
            rep.at_forward(step, torch.device("cuda", 0))
    finally:
        stragglers.CLOCK.stop()
    assert Reader.reads == len(rep.reports) >= 2  # once per report, never per step
    assert rep.reports[-1]["gpus"] == {0: hot.to_json()}
    assert dataclasses.asdict(RankSummary.from_json(json.loads(rep.store.kv[f"{rep.prefix}1/0"])).gpu) == dataclasses.asdict(hot)
