"""The straggler report: the verdict logic on synthetic summaries, and injected slowness on gloo ranks.

The multi-process tests run 4 ranks on 2 simulated nodes (ranks 0, 1 on node0; 2, 3 on node1) with a
report every ``EVERY`` steps, inject slowness from step ``START`` on, and read rank 0's reports.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import time

import pytest
import torch

from hybridshard.launcher.inject import CpuHog, SleepyLoader, shape_command, throttle_cpu
from hybridshard.runtime.faults import verdicts as V
from hybridshard.runtime.faults.verdicts import GroupTime, RankSummary, Tracker, analyse
from tests.mp import RankPool

EVERY = 20
START = 85
"""The injection's first step: inside the report that ends at step 100 (reports end at multiples of EVERY)."""


def _s(rank: int, node: str, compute: float = 0.010, step: float = 0.020, comm: dict | None = None,
       rack: str = "", nic: str = "") -> RankSummary:
    return RankSummary(rank, node, rack, nic, EVERY, step, compute, comm or {})


def _job(compute: dict[int, float] | None = None, nodes: int = 2, per_node: int = 2, step: float = 0.020,
         comm=None, racks: dict[str, str] | None = None) -> list[RankSummary]:
    compute = compute or {}
    out = []
    for r in range(nodes * per_node):
        node = f"node{r // per_node}"
        out.append(_s(r, node, compute.get(r, 0.010), step, comm(r) if comm else None, (racks or {}).get(node, "")))
    return out


# -- the verdict logic, pure ---------------------------------------------------------------------------

def test_slow_rank_is_named_by_its_compute():
    found = analyse(_job({3: 0.015}))
    assert [(v.kind, v.ranks, v.nodes) for v in found] == [("rank", (3,), ("node1",))]
    assert found[0].ratio == pytest.approx(1.5) and found[0].group == "compute"


def test_slow_node_is_every_rank_of_it():
    found = analyse(_job({2: 0.014, 3: 0.015}))
    assert [(v.kind, v.subject, v.ranks) for v in found] == [("node", "node1", (2, 3))]


def test_half_the_job_slow_is_no_outlier_and_noise_is_none():
    assert analyse(_job({0: 0.02, 1: 0.02, 2: 0.02}, nodes=4, per_node=1)) == []
    rng = random.Random(0)
    for _ in range(200):  # +-8 % noise on every figure: never a verdict
        assert analyse(_job({r: 0.010 * rng.uniform(0.92, 1.08) for r in range(8)}, nodes=4)) == []


def _pairs(slow_node: str | None, seconds: float = 0.004):
    """6 ranks on 3 nodes; replicate groups (0, 2), (1, 4), (3, 5) each cross two nodes."""
    groups = {0: (0, 2), 2: (0, 2), 1: (1, 4), 4: (1, 4), 3: (3, 5), 5: (3, 5)}
    node = lambda r: f"node{r // 2}"

    def comm(r: int) -> dict:
        members = groups[r]
        t = seconds * (2.0 if slow_node in {node(m) for m in members} else 1.0)
        return {"all_reduce@replicate": GroupTime(t, members)}
    return comm


def test_slow_link_is_the_node_only_the_slow_groups_share():
    healthy = V.transfers(_job(nodes=3, comm=_pairs(None)))
    assert analyse(_job(nodes=3, comm=_pairs("node2"))) == []  # no baseline yet: slow from the start is the probe's
    found = analyse(_job(nodes=3, comm=_pairs("node2")), healthy)
    assert [(v.kind, v.nodes, v.group) for v in found] == [("link", ("node2",), "all_reduce@replicate")]
    assert found[0].ratio == pytest.approx(2.0)
    with_nic = [dataclass_replace(s, nic="eth1") for s in _job(nodes=3, comm=_pairs("node2"))]
    assert "(eth1)" in analyse(with_nic, healthy)[0].subject


def dataclass_replace(s: RankSummary, **kw) -> RankSummary:
    import dataclasses
    return dataclasses.replace(s, **kw)


def test_a_slow_nodes_own_transfers_are_not_a_link():
    """Its compute is slow: the node is named, not its link."""
    found = analyse(_job({4: 0.02, 5: 0.02}, nodes=3, comm=_pairs("node2")), V.transfers(_job(nodes=3, comm=_pairs(None))))
    assert [(v.kind, v.subject) for v in found] == [("node", "node2")]


def test_waiting_is_not_transfer():
    """The ranks that wait for a slow peer take longer; the group's transfer is its least-waiting member's."""
    comm = lambda r: {"all_gather@shard": GroupTime(0.001 if r == 3 else 0.006, (2, 3) if r > 1 else (0, 1))}
    assert V.transfers(_job(comm=comm)) == {("all_gather@shard", (0, 1)): 0.006, ("all_gather@shard", (2, 3)): 0.001}


def _racks(scale_cross: float) -> list[RankSummary]:
    """4 nodes in 2 racks, one rank each: rack groups inside a rack, across_racks groups across."""
    racks = {"node0": "pod0/r1", "node1": "pod0/r1", "node2": "pod0/r2", "node3": "pod0/r2"}
    inside = {0: (0, 1), 1: (0, 1), 2: (2, 3), 3: (2, 3)}
    across = {0: (0, 2), 2: (0, 2), 1: (1, 3), 3: (1, 3)}

    def comm(r: int) -> dict:
        return {"all_reduce@rack": GroupTime(0.002, inside[r]),
                "all_reduce@across_racks": GroupTime(0.004 * scale_cross, across[r])}
    return _job(nodes=4, per_node=1, comm=comm, racks=racks)


def test_slow_spine_against_the_baseline_named_once_and_cleared_once():
    tracker = Tracker()
    for _ in range(3):
        assert tracker.update(_racks(1.0)) == ([], [])
    active, changes = tracker.update(_racks(1.6))
    assert active == [] and changes == []  # found once: not yet
    active, changes = tracker.update(_racks(1.6))
    assert [(v.kind, v.subject) for v in active] == [("racks", "racks pod0/r1, pod0/r2")]
    assert len(changes) == 1 and changes[0].startswith("slow racks") and "1.60x" in changes[0]
    assert tracker.update(_racks(1.6))[1] == []  # still active: not logged again
    active, changes = tracker.update(_racks(1.0))
    assert active == [] and changes == ["cleared: slow racks: racks pod0/r1, pod0/r2"]


def test_network_between_nodes_without_racks():
    tracker = Tracker()
    comm = lambda scale: (lambda r: {"all_reduce@replicate": GroupTime(0.004 * scale, (r % 2, r % 2 + 2)),
                                     "all_gather@shard": GroupTime(0.001, (r // 2 * 2, r // 2 * 2 + 1))})
    for _ in range(V.MIN_HEALTHY):
        tracker.update(_job(comm=comm(1.0)))
    for _ in range(2):
        active, _ = tracker.update(_job(comm=comm(1.5)))
    assert [(v.kind, v.subject, v.group) for v in active] == [("link", "the network between nodes", "all_reduce@replicate")]


def test_balanced_slowdown_against_each_ranks_baseline():
    tracker = Tracker()
    for _ in range(V.MIN_HEALTHY):
        tracker.update(_job())
    tracker.update(_job(step=0.030, compute={r: 0.016 for r in range(4)}))
    active, changes = tracker.update(_job(step=0.030, compute={r: 0.016 for r in range(4)}))
    assert [(v.kind, v.ranks) for v in active] == [("balanced", (0, 1, 2, 3))]
    assert "every rank computes more" in active[0].action and len(changes) == 1


def test_no_baseline_from_fewer_than_three_healthy_reports():
    """Two healthy reports, then the network 1.5x slower: no link verdict in the two reports a verdict
    needs, since no baseline of MIN_HEALTHY reports exists yet (a baseline of one or two reports under
    load gave a false "slow link" once)."""
    tracker = Tracker()
    comm = lambda scale: (lambda r: {"all_reduce@replicate": GroupTime(0.004 * scale, (r % 2, r % 2 + 2)),
                                     "all_gather@shard": GroupTime(0.001, (r // 2 * 2, r // 2 * 2 + 1))})
    for _ in range(V.MIN_HEALTHY - 1):
        tracker.update(_job(comm=comm(1.0)))
    assert tracker.baselines() == {}
    for _ in range(2):  # what a verdict needs to persist, against a baseline of the 2 healthy reports
        assert tracker.update(_job(comm=comm(1.5)))[0] == []


def test_a_verdict_must_persist_and_a_new_one_is_logged_once():
    tracker = Tracker()
    assert tracker.update(_job({3: 0.02})) == ([], [])
    assert tracker.update(_job()) == ([], [])  # one report is no verdict
    tracker.update(_job({3: 0.02}))
    active, changes = tracker.update(_job({3: 0.02}))
    assert [v.subject for v in active] == ["rank 3 (node1)"] and len(changes) == 1
    active, changes = tracker.update(_job({0: 0.02}))  # another rank: rank 3 cleared, rank 0 not yet
    assert active == [] and changes == ["cleared: slow rank: rank 3 (node1)"]


def test_summary_travels_as_json():
    s = _s(3, "node1", comm={"all_gather@shard": GroupTime(0.001, (2, 3))}, rack="pod0/r2", nic="eth0")
    assert RankSummary.from_json(json.loads(json.dumps(s.to_json()))) == s


def test_injection_tools():
    assert shape_command("hs-n1", "veth1", "100mbit")[:10] == ["ip", "netns", "exec", "hs-n1", "tc", "qdisc",
                                                             "change", "dev", "veth1", "root"]
    with pytest.raises(ValueError, match="expects verb"):
        shape_command("n", "d", "1mbit", verb="set")
    with pytest.raises(ValueError, match="expects a fraction"):
        throttle_cpu(os.getpid(), 0.0)
    started = time.perf_counter()
    assert list(SleepyLoader(range(3), seconds=0.01, start=1)) == [0, 1, 2]
    assert time.perf_counter() - started >= 0.02
    with CpuHog(0.5):
        pass


# -- injected slowness on gloo ranks -------------------------------------------------------------------

_GROUPS: dict = {}


def train(steps: int, inject: str = "", target: int = 3, factor: float = 1.0, load: bool = False,
          executor: str | None = None, strategy: str = "HYBRID_SHARD", micro: int = 1) -> dict:
    """Train the tiny model ``steps`` steps with the report on; from step ``START`` on, rank ``target`` is
    slowed: ``"sleep"`` (its loader sleeps ``factor`` x the median step so far), ``"hog"`` (a CPU hog
    thread), ``"node"`` (both ranks of node1 sleep). ``load``: a CPU hog on every rank (background load).
    ``micro`` > 1: that many micro-batches a step, all but the last under ``no_sync``."""
    import torch.distributed as dist

    import hybridshard as hs
    from benchmarks.tiny_lm import Block, batch, lm_loss, make_model
    from hybridshard.runtime.faults import stragglers
    from hybridshard.runtime.trace.position import where

    os.environ["HYBRIDSHARD_STRAGGLER_STEPS"] = str(EVERY)
    if not _GROUPS:
        _GROUPS["g"] = hs.init_groups()
    rank = dist.get_rank()
    model = hs.shard(make_model(), strategy=strategy, groups=_GROUPS["g"], wrap={Block}, stragglers=True,
                     executor=executor)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    first = where.step
    assert first % EVERY == 0, "each run starts on a report boundary"
    slow = inject and (rank == target or (inject == "node" and rank // 2 == 1))
    hog = CpuHog(0.3).start() if load else None
    times, extra = [], None
    for i in range(steps):
        if slow and i == START:
            delay = factor * sorted(times)[len(times) // 2]
            extra = CpuHog(0.9).start() if inject == "hog" else None
        started = time.perf_counter()
        tokens = next(iter(SleepyLoader([batch(i, 0, rank, 4)], seconds=delay if slow and i >= START and
                                         inject in ("sleep", "node") else 0.0)))
        for m in range(micro):
            with hs.no_sync(model) if m < micro - 1 else contextlib.nullcontext():
                lm_loss(model(tokens), tokens).backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - started)
    for h in (hog, extra):
        if h is not None:
            h.stop()
    reports = stragglers.reporter().reports
    stragglers.reset()
    from hybridshard.runtime.trace import host_syncs
    syncs = {str(k): v for k, v in host_syncs.counts().steady(first + 1).items()} if executor == "emulate" else {}
    return {"first": first, "reports": reports, "syncs": syncs}


@pytest.fixture(scope="module")
def pool():
    with RankPool(4, num_nodes=2, layout="block") as p:
        yield p


def _named(result: dict, kind: str, subject: str) -> bool:
    """Whether the first verdict active from the injection's report on is ``(kind, subject)``, within 2
    reports of the injection's start (the report it starts in, or the next)."""
    for rec in result["reports"]:
        steps = rec["steps"] - result["first"]
        if steps < _start_report() or not rec["active"]:
            continue
        return steps <= _start_report() + EVERY and [(a["kind"], a["subject"]) for a in rec["active"]] == [(kind, subject)]
    return False


def _start_report() -> int:
    """Steps from the run's start to the end of the report the injection starts in."""
    return (START // EVERY + 1) * EVERY


def _runs(pool, n: int, **kw) -> list[dict]:
    return [pool.run(train, 160, **kw)[0] for _ in range(n)]


def _show(results: list[dict]) -> str:
    return "\n".join(f"{r['steps'] - res['first']}: {r['ranks']} {[a['subject'] for a in r['active']]}"
                     for res in results for r in res["reports"])


@pytest.mark.parametrize("inject,target,kind,subject", [
    ("sleep", 3, "rank", "rank 3 (node1)"),
    ("node", 2, "node", "node1"),
])
def test_sleeping_loader_is_named_within_two_reports(pool, inject, target, kind, subject):
    results = _runs(pool, 3, inject=inject, target=target, factor=0.8)  # timing on a shared machine: 2 of 3
    assert sum(_named(r, kind, subject) for r in results) >= 2, _show(results)


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD_ZERO2"])
def test_every_strategy_with_no_sync_names_the_sleeping_rank(pool, strategy):
    """Two micro-batches a step (the first under no_sync); rank 3's loader sleeps from step START on."""
    results = [pool.run(train, 140, inject="sleep", target=3, factor=0.8, strategy=strategy, micro=2)[0]
               for _ in range(2)]  # timing on a shared machine: 1 of 2
    assert any(_named(r, "rank", "rank 3 (node1)") for r in results), _show(results)


def test_throttled_rank_is_named(pool):
    """A hog thread in rank 1 (the substitute for cgroup v2's cpu.max, absent here): on this 2-core machine
    it also slows rank 1's neighbours' share of the cores, so rank 1 or its node is named, never node1.
    Two cores shared by four ranks and a hog make its share of the slowdown uneven from run to run: the
    test asks for the verdict at some report after the injection in one run of three, not within two."""
    results = _runs(pool, 3, inject="hog", target=1)

    def named_later(result: dict) -> bool:
        return any((a["kind"], a["subject"]) in (("rank", "rank 1 (node0)"), ("node", "node0"))
                   for rec in result["reports"] if rec["steps"] - result["first"] >= _start_report()
                   for a in rec["active"])

    assert sum(named_later(r) for r in results) >= 1, _show(results)
    # node1's ranks may be slowed too (two cores under CI's other worker), but never more often than rank 1
    about = lambda ranks: sum(bool(set(a["ranks"]) & ranks) for r in results for rec in r["reports"] for a in rec["active"])
    assert about({2, 3}) < about({0, 1}), _show(results)


def test_healthy_run_under_background_load_names_nothing(pool):
    """No rank, node or link is named; a balanced slowdown is what other jobs on this machine cause."""
    for attempt in range(2):
        result = pool.run(train, 200, load=attempt == 1)[0]
        assert len(result["reports"]) >= 8
        named = [a for r in result["reports"] for a in r["active"] if a["kind"] != "balanced"]
        assert not named, _show([result])


def test_emulated_device_makes_no_host_sync_while_timing(pool):
    """Under executor="emulate" the step timing and the report add no hot-path host sync (from the run's
    second step on), and the report still comes."""
    results = pool.run(train, 60, executor="emulate")
    assert all(r["syncs"] == {} for r in results), [r["syncs"] for r in results]
    assert len(results[0]["reports"]) >= 2
