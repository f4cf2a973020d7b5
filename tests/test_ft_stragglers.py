"""The straggler report in a fault-tolerant job: a replica group that turns slow mid-run is named as a
slow replica group by its own report ([Note: slow replica groups]).

Two replica groups of 2 ranks on 127.0.0.1 (tests/ft/cluster.py), one lighthouse in this process, the
worker of tests/test_ft.py; each group is its own job, so each group's rank 0 writes its own
``stragglers.jsonl`` in its run directory.
"""

from __future__ import annotations

import time

import pytest

from tests.ft.cluster import Group
from tests.test_ft import _cleaned_up, _lighthouse, _read

pytestmark = pytest.mark.multiprocess

EVERY = 10
"""HYBRIDSHARD_STRAGGLER_STEPS: a report every 10 steps."""
SLOW_FROM = 6 * EVERY
"""The step replica group 1 turns slow at: a report boundary, after 3 healthy reports for the baselines
and 3 more judged against them."""
STEPS = SLOW_FROM + 2 * EVERY + 4
"""Two reports of slow steps, and a few steps for rank 0 to read the last one."""
SLEEP_S = 0.025
"""Replica group 1's extra work per step from SLOW_FROM on: about one healthy step (~25 ms here)."""


def _run_job(tmp_path, monkeypatch) -> str | None:
    """One job; what its reports got wrong (see :func:`_problem`), or how it failed to finish, or None."""
    lighthouse = _lighthouse(min_replicas=2)
    groups = [Group(i, 2, str(tmp_path)) for i in range(2)]
    run_dirs = [tmp_path / f"run{i}" for i in range(2)]
    with _cleaned_up(groups, lighthouse):
        for g, run_dir in zip(groups, run_dirs):
            run_dir.mkdir()
            monkeypatch.setenv("HYBRIDSHARD_RUN_DIR", str(run_dir))  # Group.start hands its environment on
            slow = ["--sleep", str(SLEEP_S), "--sleep-from", str(SLOW_FROM)] if g.replica == 1 else []
            g.start(lighthouse.address(), ["--steps", str(STEPS), "--min-replicas", "2", "--timeout", "10", *slow])
        deadline = time.monotonic() + 30  # a job takes ~10 s
        codes = [g.wait(deadline - time.monotonic()) for g in groups]
    if codes != [[0, 0], [0, 0]]:
        return f"exit codes {codes} (None: still running after 30 s)\n" + "\n".join(g.output() for g in groups)
    with open(groups[1].log(0) + ".out", errors="replace") as f:
        return _problem([_read(str(run_dir / "stragglers.jsonl")) for run_dir in run_dirs], f.read())


def _active(records: list[dict]) -> list[tuple[int, list[tuple[str, str]]]]:
    return [(r["report"], [(v["kind"], v["subject"]) for v in r["active"]]) for r in records]


def _problem(reports: list[list[dict]], out: str) -> str | None:
    """What the job's reports got wrong, or None."""
    first_slow = SLOW_FROM // EVERY + 1  # the first report over slow steps only
    for replica, records in enumerate(reports):
        if [r["report"] for r in records] != list(range(1, len(records) + 1)) or len(records) < first_slow + 1:
            return f"replica group {replica} wrote reports {[r['report'] for r in records]}, expected 1..{first_slow + 1}"
        if any(r["replica_group"] != f"replica{replica}" for r in records):
            return f"replica group {replica}'s reports name other groups: {[r['replica_group'] for r in records]}"
        before = [r for r in records if r["steps"] <= SLOW_FROM]
        # a balanced slowdown of a whole group is what other work starting on this machine causes
        if any(v["kind"] != "balanced" for r in before for v in r["active"]):
            return f"replica group {replica} found a slow verdict before step {SLOW_FROM}: {_active(before)}"
    slow = [r for r in reports[1] if first_slow <= r["report"] <= first_slow + 1]
    named = [v for r in slow for v in r["active"] if v["kind"] == "replica_group"]
    if not named:
        return f"no active replica_group verdict in replica group 1's reports {first_slow}..{first_slow + 1}: {_active(slow)}"
    healthy = [v for r in reports[0] if r["report"] >= first_slow for v in r["active"] if v["kind"] == "replica_group"]
    if healthy:  # group 0 waits for group 1 in torchft's quorum and all-reduce: waiting, not computing
        return f"the healthy replica group 0 named itself slow: {healthy}"
    v = named[0]
    if (v["subject"], v["group"], v["nodes"]) != ("replica group replica1", "compute", ["node1"]) or v["ratio"] < 1.3:
        return f"replica group 1's verdict names the wrong subject or evidence: {v}"
    if "hybridshard stragglers (report" not in out or "slow replica_group: replica group replica1" not in out:
        return "replica group 1's rank 0 did not log the verdict at WARNING:\n" + out[-3000:]
    return None


def test_a_slow_replica_group_is_named_by_its_report(tmp_path, monkeypatch):
    """2 replica groups x 2 ranks in one quorum from step 0, a report every 10 steps; from step 60
    every rank of replica group 1 sleeps ~ a step more. No group's rank 0 writes an active verdict but a balanced slowdown in
    the reports before the sleep; group 1's second report after it (at the latest) holds the verdict
    ``replica_group`` naming replica1, also logged at WARNING. Shared machine: one more try when the
    first job fails (other work starting on it reads as every group slowing, or stalls a quorum)."""
    monkeypatch.setenv("HYBRIDSHARD_STRAGGLERS", "1")
    monkeypatch.setenv("HYBRIDSHARD_STRAGGLER_STEPS", str(EVERY))
    monkeypatch.delenv("HYBRIDSHARD_STRAGGLER_LOG", raising=False)
    problems = []
    for attempt in range(2):
        (tmp_path / str(attempt)).mkdir()
        problems.append(_run_job(tmp_path / str(attempt), monkeypatch))
        if problems[-1] is None:
            return
    pytest.fail("\n".join(f"job {i + 1}: {p}" for i, p in enumerate(problems)))
