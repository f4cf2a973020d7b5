"""The straggler report on the local cluster: one host's link and the spine shaped down mid-run (tc, in
network namespaces), named by kind and subject; a healthy run names nothing.

Every job is tests/straggler_cluster_job.py on 4 hosts in 2 racks, one rank a host (the replicate
reduction in two hops: rack groups and across-racks groups cross different hosts), a report every
20 steps, the link or the spine shaped as rank 0 prints ``step 100`` (benchmarks/straggler_detection.py
runs them and judges them). Shared machine, so each job gets one more try when its verdict is wrong.
"""

from __future__ import annotations

import json
import os
import sys
import time

import pytest

from benchmarks.straggler_detection import EXPECTED, RunResult, run_once
from hybridshard.launcher import local_cluster
from hybridshard.launcher.local_cluster import ClusterOptions
from hybridshard.launcher.netns import HostSpec, LocalNetwork, check_rights
from hybridshard.launcher.spine_run import EVENTS_FILE, NetWatch, RateChange, read_counters
from hybridshard.runtime.faults.verdicts import RankSummary, Tracker

FIXTURES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fixtures", "stragglers_cluster")
NO_RIGHTS = check_rights()
if NO_RIGHTS:
    print(f"\nlocal-cluster straggler tests skipped: {NO_RIGHTS}", file=sys.stderr)
needs_netns = pytest.mark.skipif(NO_RIGHTS is not None, reason=f"cannot create network namespaces: {NO_RIGHTS}")


# -- without namespaces --------------------------------------------------------------------------

def test_rate_changes_are_parsed_and_validated():
    assert RateChange.parse("host3=50mbit", when="step 4 ") == RateChange("50mbit", 3, None, "step 4 ")
    assert RateChange.parse("spine=1gbit", after_s=2.0).target == "the spine"
    with pytest.raises(ValueError, match=r"^expected --set-rate host<K>=RATE or spine=RATE, found 'rack1=1mbit'"):
        RateChange.parse("rack1=1mbit", after_s=1.0)
    with pytest.raises(ValueError, match=r"^expected a tc rate in --set-rate, found 'fast'"):
        RateChange.parse("host1=fast", after_s=1.0)
    with pytest.raises(ValueError, match=r"^expected one of --set-rate-after or --set-rate-when, found neither"):
        RateChange("1mbit", 1)
    with pytest.raises(ValueError, match=r"^expected --racks with --set-rate spine=RATE"):
        ClusterOptions(num_nodes=2, procs_per_node=1, command=("x",), rate_changes=(RateChange("1mbit", None, 1.0),))
    with pytest.raises(ValueError, match=r"^expected --set-rate host0..host1, found host2"):
        ClusterOptions(num_nodes=2, procs_per_node=1, command=("x",), rate_changes=(RateChange("1mbit", 2, 1.0),))


def test_cli_names_the_rate_options(capsys):
    assert local_cluster.main(["--nodes", "2", "--set-rate", "host1=1mbit", "--", "true"]) == 2
    assert "expected one of --set-rate-after or --set-rate-when, found neither" in capsys.readouterr().err


class _FakeNet:
    spine = None

    def __init__(self) -> None:
        self.hosts = LocalNetwork(4, tag="hslctest").hosts
        self.calls: list[tuple[str, str]] = []

    def set_host_rate(self, host: HostSpec, rate: str) -> None:
        self.calls.append((host.name, rate))


def test_a_rate_change_is_made_once_on_its_line_and_logged(tmp_path):
    net, said = _FakeNet(), []
    watch = NetWatch(net, said.append, str(tmp_path), changes=(RateChange("20mbit", 3, None, r"step 4 $"),))
    for line in ("step 3 ", "step 4 ", "step 4 ", "step 40 "):
        watch.on_line("host0", line)
    assert net.calls == [("host3", "20mbit")]
    assert said == ["shaped host3's link to 20mbit (host0 printed a line matching 'step 4 $')"]
    [event] = read_counters(str(tmp_path / EVENTS_FILE))
    assert (event["event"], event["target"], event["rate"]) == ("rate", "host3's link", "20mbit")
    assert watch.stop() == ""  # no racks: no counters


def _replay(name: str) -> list[set[tuple[str, str]]]:
    tracker = Tracker()
    with open(os.path.join(FIXTURES, name)) as f:
        return [{v.key for v in tracker.update([RankSummary.from_json(s) for s in json.loads(line)])[0]}
                for line in f]


@pytest.mark.parametrize("name,expected", [("link_host3.jsonl", EXPECTED["link"]), ("spine.jsonl", EXPECTED["spine"])])
def test_recorded_cluster_summaries_name_the_link_and_the_spine(name, expected):
    """Summaries recorded on the local cluster (tests/straggler_cluster_job.py --dump; shaped from step
    100, a report every 20 steps): nothing before, the slowness named at the second report after it."""
    active = _replay(name)
    assert active[:6] == [set()] * 6 and active[6] == {expected}, active


# -- with namespaces ----------------------------------------------------------------------------

def _judged(kind: str, tmp_path, **kw) -> RunResult:
    """A run of ``kind``; again once when it is not named right (the machine is shared)."""
    for attempt in range(2):
        started = time.monotonic()
        result = run_once(kind, str(tmp_path / f"{kind}-{attempt}"), timeout_s=100.0, **kw)
        print(f"\n{kind} (try {attempt}): {time.monotonic() - started:.0f}s, slow from step {result.start}, step "
              f"ratio {result.step_ratio()}, reports:\n{result.show()}")
        assert result.rc == 0, result.output
        ok = not result.false_before() and (kind == "healthy" or result.named(EXPECTED[kind]))
        if ok:
            break
    return result


@needs_netns
def test_slow_link_names_the_host_and_its_nic(tmp_path):
    result = _judged("link", tmp_path, link_rate="100mbit")
    assert result.named(("link", "host3's link (eth0)")), result.show()
    assert result.false_before() == [], result.show()
    assert result.step_ratio() >= 1.3


@needs_netns
def test_slow_spine_names_the_racks(tmp_path):
    result = _judged("spine", tmp_path, spine_rate="50mbit")
    assert result.named(("racks", "racks pod0/rack0, pod0/rack1")), result.show()
    assert result.false_before() == [], result.show()
    assert result.step_ratio() >= 1.3


@needs_netns
def test_healthy_run_names_nothing(tmp_path):
    result = _judged("healthy", tmp_path, load=0.3)
    assert len(result.reports) >= 10 and result.false_before() == [], result.show()
