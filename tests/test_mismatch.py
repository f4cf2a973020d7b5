"""Control-plane faults with every rank alive, or with the store gone: named on every rank, never a hang.

- A job-wide call made on some ranks only (``if rank == 0: hs.full_state_dict(model)`` then a barrier)
  stops every rank within ``HYBRIDSHARD_MISMATCH_SECONDS`` plus a few seconds, naming the call, the
  rank in it and where the others are (see [Note: entry point on some ranks only]).
- A rank that is merely late (sleeping outside any collective while the others wait) is never reported.
- When the first failing rank hosts the store and takes it down, the survivors still name it and what
  it raised (see [Note: keeping the causes]).

4 plain processes per job (``tests/mismatch_job.py``), a 60 s process-group timeout so that only the
watchdog can end a hang within the deadlines asserted here.
"""

from __future__ import annotations

import functools
import json
import os
import re
import threading
import time
import types
import weakref

import pytest

from tests.mp import read_results, run_rank_processes

pytestmark = pytest.mark.multiprocess

JOB = os.path.join(os.path.dirname(__file__), "mismatch_job.py")
MISMATCH_SECONDS = 2.0
SLACK = 12.0  # poll, confirmation and exit; generous for a loaded machine
REPEATS = 2


def _run(scenario: str, env: dict[str, str] | None = None) -> list[dict]:
    env = {"HYBRIDSHARD_MISMATCH_SECONDS": str(MISMATCH_SECONDS), **(env or {})}
    ranks = run_rank_processes([JOB, scenario], 4, timeout=120, env=env)
    out = []
    for rank, (code, text, _, ended) in enumerate(ranks):
        assert code is not None, f"rank {rank} hung (killed at the timeout):\n{text[-3000:]}"
        results = read_results(text)
        step1 = [float(line.split()[1]) for line in text.splitlines() if line.startswith("STEP1 ")]
        out.append({"code": code, "text": text, "result": results[-1] if results else None,
                    "after_step1": ended - step1[0] if step1 else None})
    return out


def test_entry_point_called_on_one_rank_stops_every_rank_naming_it():
    for _ in range(REPEATS):
        ranks = _run("entry_alone")
        for rank, r in enumerate(ranks):
            assert r["code"] == 1, (rank, r["text"][-3000:])
            first = [line for line in r["text"].splitlines() if "must be called on every rank" in line]
            assert first, (rank, r["text"][-3000:])
            assert re.match(r"full_state_dict must be called on every rank, but only rank 0 entered it \(call #1\)"
                            r", while ranks 1, 2, 3 are blocked in barrier at \S*mismatch_job\.py:\d+ \(main\), "
                            r"every rank for over 2s \(HYBRIDSHARD_MISMATCH_SECONDS\)", first[0]), first[0]
            # rank 0's line names the user's call (mismatch_job.py), not a frame of the package or torch
            assert re.search(r"rank 0: inside full_state_dict \(call #1 on this rank\), blocked in all_gather on the "
                             r"shard group at \S*mismatch_job\.py:\d+ \(main\) \(waiting at hybridshard/", r["text"]), r["text"][-3000:]
            for other in (1, 2, 3):
                assert re.search(rf"rank {other}: in no entry point of the package, blocked in barrier at "
                                 r"\S*mismatch_job\.py:\d+ \(main\)", r["text"]), r["text"][-3000:]
            assert f"Every rank stops now (rank {rank} too)" in r["text"]
            # Found once every rank was blocked that long, long before the 60 s process-group timeout.
            assert MISMATCH_SECONDS <= r["after_step1"] < MISMATCH_SECONDS + SLACK, r["after_step1"]


def test_late_rank_outside_collectives_is_never_reported():
    # Twice, rank 3 sleeps twice the limit before full_state_dict and before a barrier while the others
    # wait in them: 4 waits of every other rank, inside an entry point and outside any.
    ranks = _run("late", env={"LATE_SECONDS": str(2 * MISMATCH_SECONDS), "ROUNDS": "2"})
    for rank, r in enumerate(ranks):
        assert r["code"] == 0 and r["result"]["outcome"] == "ok", (rank, r["text"][-3000:])
        assert "must be called on every rank" not in r["text"], r["text"][-3000:]


def test_first_failing_rank_that_hosts_the_store_is_still_named():
    # Rank 0 hosts the store (no agent store) and raises at step 1: its exit takes the store down.
    for _ in range(REPEATS):
        ranks = _run("host_raises", env={"JOB_STORE_ON_RANK0": "1"})
        assert ranks[0]["result"]["type"] == "ValueError" and ranks[0]["code"] == 1, ranks[0]["text"][-3000:]
        for rank in (1, 2, 3):
            r = ranks[rank]["result"]
            assert r is not None and r["type"] == "CollectiveError", ranks[rank]["text"][-3000:]
            first = r["message"].splitlines()[0]
            assert first.startswith("rank 0 raised ValueError: a bad batch on rank 0; so "), r["message"]
            # Whether the store is still up when a survivor writes this depends on timing (rank 0 waits
            # until the others have seen its cause before it exits): either it names the cause it kept,
            # or it read rank 0's own record. The kept path alone: the test below.
            assert ("kept by this rank: the job's store could not be reached" in first
                    or re.search(r"raised\s+rank 0 raised ValueError: a bad batch on rank 0", r["message"])), r["message"]
            assert r["seconds"] < 30, r


class _Store:
    """A dict with the calls of a c10d store that the mismatch check makes, counted by name."""

    def __init__(self, records: dict[int, dict]) -> None:
        self.data = {f"hybridshard/blocked/{r}": json.dumps(v).encode() for r, v in records.items()}
        self.data["hybridshard/blocked"] = len(records)  # the count of published records
        self.ops: dict[str, int] = {}

    def _op(self, name):
        self.ops[name] = self.ops.get(name, 0) + 1

    def check(self, keys):
        self._op("check")
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        self._op("multi_get")
        return [self.data[k] for k in keys]

    def get(self, key):
        self._op("get")
        return self.data[key]

    def set(self, key, value):
        self._op("set")
        self.data[key] = value

    def add(self, key, n):
        self._op("add")
        self.data[key] = self.data.get(key, 0) + n
        return self.data[key]


def _record(entry, call="barrier", at="train.py:9 (main)", age=10.0):
    return {"blocked": True, "entry": entry, "call": call, "at": at, "inner": at, "since": -age,
            "text": f"blocked in {call} at {at}"}  # since: made relative to now by _now()


def _now(records):
    now = time.time()
    return {r: {**v, "since": now + v["since"]} for r, v in records.items()}


@pytest.mark.parametrize("records,stops", [
    ({0: _record([["full_state_dict", 3]]), 1: _record([]), 2: _record([]), 3: _record([])}, True),
    ({0: _record([["full_state_dict", 3]]), 1: _record([["save_checkpoint", 3]])}, True),
    ({0: _record([["save_checkpoint", 4]]), 1: _record([["save_checkpoint", 3]])}, True),  # one call more on rank 0
    ({0: _record([["save_checkpoint", 3]]), 1: _record([["save_checkpoint", 3]])}, False),  # slow, not mismatched
    ({0: _record([]), 1: _record([], call="all_reduce")}, False),  # no entry point: the hang report's business
    ({0: _record([["full_state_dict", 3]]), 1: _record([], age=1.0)}, False),  # rank 1 not blocked long enough
    ({0: _record([["full_state_dict", 3]])}, False),  # rank 1 published nothing: running, so late at most
])
def test_mismatch_needs_every_rank_blocked_in_different_calls(monkeypatch, records, stops):
    from hybridshard.runtime.faults import mismatch

    stopped = []
    monkeypatch.setattr(mismatch.MismatchWatch, "_stop", lambda self, s, me, world, recs, limit: stopped.append(recs))
    watch = mismatch.MismatchWatch()
    records = _now(records)
    watch._published = records[0]["since"]  # rank 0's own record, as its poll published it
    store = _Store(records)
    watch._check(store, 0, 2 if len(records) < 4 else 4, 5.0)
    assert not stopped  # the first reading is only confirmed by the next one
    watch._check(store, 0, 2 if len(records) < 4 else 4, 5.0)
    assert bool(stopped) == stops, records


def test_only_rank0_reads_every_record_and_a_rank_that_moved_on_never_votes(monkeypatch):
    """W ranks waiting cost the store O(W) per check, not O(W^2): the others read the count and
    rank 0's verdict; a rank whose own record changed since the verdict does not stop."""
    from hybridshard.runtime.faults import mismatch

    stopped = []
    monkeypatch.setattr(mismatch.MismatchWatch, "_stop", lambda self, s, me, world, recs, limit: stopped.append(me))
    records = _now({0: _record([["full_state_dict", 3]]), 1: _record([]), 2: _record([]), 3: _record([])})
    store = _Store(records)
    watches = {}
    for me in (1, 2, 3, 0, 0, 1, 2, 3):  # rank 0 confirms at its second reading and writes the verdict
        watch = watches.setdefault(me, mismatch.MismatchWatch())
        watch._published = records[me]["since"]
        watch._check(store, me, 4, 5.0)
    assert stopped == [0, 1, 2, 3]
    assert store.ops["multi_get"] == 2  # rank 0's two readings; the others read one key
    stopped.clear()
    moved = mismatch.MismatchWatch()
    moved._published = records[2]["since"] + 1.0  # rank 2 has been blocked somewhere else since
    moved._check(store, 2, 4, 5.0)
    assert stopped == []
    store.data["hybridshard/blocked"] = 3  # one rank cleared its record: nobody reads anything more
    before = dict(store.ops)
    watches[0]._check(store, 0, 4, 5.0)
    assert store.ops["add"] == before["add"] + 1 and store.ops.get("multi_get") == before["multi_get"]


def test_a_poll_keeps_no_frame_of_the_main_thread_alive(monkeypatch):
    """A poll that lands while the main thread waits inside the package must not keep that wait's
    callers' locals alive after they returned (see [Note: no frame kept]): a held frame kept a
    backward's gradient shards alive past ``zero_grad(set_to_none=True)``. Run 5 times: the poll and
    the wait race by design."""
    from hybridshard.runtime.comm.collectives import Pending
    from hybridshard.runtime.trace import entry_points

    monkeypatch.setattr(entry_points, "_MAIN", threading.current_thread())  # the thread this test runs on

    class Work:
        wait = functools.partial(time.sleep, 0.4)  # blocks in C: the innermost Python frame is Pending.wait

        def is_completed(self) -> bool:
            return True

    class Held:
        """What a caller of the wait holds (a gradient shard)."""

    pending = [types.SimpleNamespace(kind="all_reduce", group="replicate", started=1.0)]
    for _ in range(5):
        watch, seen = entry_points.MainThreadWatch(), []

        def poll() -> None:
            time.sleep(0.1)
            seen.append(watch.observe(pending))

        def step() -> weakref.ref:
            held = Held()
            Pending(Work(), "all_reduce", "replicate").wait()
            return weakref.ref(held)

        thread = threading.Thread(target=poll)
        thread.start()
        ref = step()
        thread.join(10)
        assert seen and seen[0].blocked and "collectives.py" in seen[0].inner, seen  # the poll saw the wait
        assert ref() is None, "the watchdog kept the main thread's returned frames (and their locals) alive"


def test_the_next_collective_in_flight_starts_a_new_episode(monkeypatch):
    """With no frame kept, one wait is told from the next at the same frame by the first collective in
    flight: the same one keeps the episode, a new one starts another."""
    from hybridshard.runtime.comm.collectives import Pending
    from hybridshard.runtime.trace import entry_points

    monkeypatch.setattr(entry_points, "_MAIN", threading.current_thread())

    class Work:
        wait = functools.partial(time.sleep, 0.8)

        def is_completed(self) -> bool:
            return True

    first = [types.SimpleNamespace(kind="all_reduce", group="replicate", started=1.0)]
    second = [types.SimpleNamespace(kind="all_reduce", group="replicate", started=2.0)]
    watch, seen = entry_points.MainThreadWatch(), []

    def poll() -> None:
        for pending in (first, first, second):
            time.sleep(0.15)
            seen.append(watch.observe(pending))

    thread = threading.Thread(target=poll)
    thread.start()
    Pending(Work(), "all_reduce", "replicate").wait()
    thread.join(10)
    assert all(b.blocked for b in seen) and seen[0].since == seen[1].since < seen[2].since, seen


def test_mismatch_message_names_both_calls():
    from hybridshard.runtime.faults.mismatch import describe

    records = _now({0: _record([["full_state_dict", 3]], call="all_gather on the shard group"),
                    1: _record([["save_checkpoint", 3]], call="all_gather_object", at="train.py:20 (main)")})
    records = [records[0], records[1]]
    first = describe(1, records, 30.0).splitlines()[0]
    assert first.startswith("full_state_dict must be called on every rank, but only rank 0 entered it ("
                            "call #3), while rank 1 is blocked in save_checkpoint (call #3), "
                            "all_gather_object at train.py:20 (main), every rank for over 30s"), first


def test_mismatch_message_for_one_call_more_on_one_rank():
    from hybridshard.runtime.faults.mismatch import describe

    records = _now({0: _record([["save_checkpoint", 4]]), 1: _record([["save_checkpoint", 3]]),
                    2: _record([["save_checkpoint", 3]])})
    first = describe(0, [records[r] for r in range(3)], 30.0).splitlines()[0]
    assert first.startswith("save_checkpoint must be called the same number of times on every rank, but ranks 1, 2 "
                            "are in call #3; rank 0 is in call #4, every rank blocked for over 30s"), first


def test_every_public_collective_call_is_an_announced_entry_point():
    import hybridshard as hs
    from hybridshard.runtime.trace.position import api_call

    wrapper_code = api_call(lambda: None).__code__
    collective = ["full_state_dict", "load_full_state_dict", "full_optim_state_dict", "load_full_optim_state_dict",
                  "save_checkpoint", "load_checkpoint", "save_pretrained", "load_pretrained", "check_replicas",
                  "clip_grad_norm_", "gather_updated_params"]
    for name in collective:
        assert getattr(hs, name).__code__ is wrapper_code, f"hs.{name} is not announced as an entry point"


def test_stuck_collective_names_a_kept_cause_when_the_store_is_gone(monkeypatch):
    # On NCCL a collective whose peer died stays stuck; the fault check then finds the store gone too.
    from hybridshard.runtime.faults import causes
    from hybridshard.runtime.faults import errors, peers

    monkeypatch.setattr(peers, "store", lambda: None)
    monkeypatch.setattr(peers, "identity", lambda: (2, 4))
    assert errors.peers_gone("all_reduce", "replicate", [0, 2], "step 3", 61.0, {}) is None  # nothing kept
    from hybridshard.runtime.faults.rank_state import current

    monkeypatch.setattr(current(), "causes", {"kept": {0: "rank 0 raised ValueError: a bad batch on rank 0"}})
    message = errors.peers_gone("all_reduce", "replicate", [0, 2], "step 3", 61.0, {})
    assert message.splitlines()[0] == ("rank 0 raised ValueError: a bad batch on rank 0; so all_reduce on the "
                                       "replicate group (ranks [0, 2]) cannot complete on rank 2 (step 3) (kept by "
                                       "this rank: the job's store could not be reached after that)."), message
    assert errors.peers_gone("all_reduce", "replicate", [1, 2], "step 3", 61.0, {}) is None  # rank 0 not in the group


def test_each_rank_keeps_its_own_causes_and_a_new_store_starts_a_new_list():
    """Per rank (the scale harness runs ranks as threads of one process) and per store (a pooled test
    process runs one job after another): one rank reading a cause does not read it for another, and a
    new job's first cause is read although the last job had more."""
    import json

    from hybridshard.runtime.faults import causes
    from hybridshard.runtime.faults.rank_state import ControlPlane, bound

    def store_with(n_causes):
        s = __import__("torch").distributed.HashStore()
        for k in range(1, n_causes + 1):
            s.add("hybridshard/causes", 1)
            s.set(f"hybridshard/cause/{k}", json.dumps({"rank": 0, "text": f"cause {k}"}).encode())
        return s

    first = store_with(3)
    planes = [ControlPlane(first, rank, 4) for rank in (1, 2)]
    for plane in planes:
        with bound(plane):
            causes.poll()
            assert causes.kept() == {0: "cause 1"}
    assert int(first.add("hybridshard/cause/1/seen", 0)) == 2  # each rank acknowledged it
    second = store_with(1)
    planes[0].found["store"] = second
    second.set("hybridshard/cause/1", json.dumps({"rank": 3, "text": "new job"}).encode())
    with bound(planes[0]):
        causes.poll()
        assert causes.kept() == {3: "new job"}


def test_a_waiting_rank_reads_the_causes_once_every_poll_every_seconds(monkeypatch):
    # A stall keeps every rank waiting: one read of the count per poll (each second) was a third of the
    # store operations of a fault check (docs/scale.md); once every poll_every() still acknowledges a
    # cause well inside the HYBRIDSHARD_CAUSE_WAIT a dying rank gives its peers.
    import types

    from hybridshard.runtime.faults import causes
    from hybridshard.runtime.faults.rank_state import ControlPlane, bound

    class Store:
        reads = 0

        def add(self, key, n):
            Store.reads += 1
            return 0

    monkeypatch.delenv("HYBRIDSHARD_CAUSE_WAIT", raising=False)
    assert causes.poll_every() == 2.0 and 2.5 * causes.poll_every() <= causes.wait_seconds()
    monkeypatch.setenv("HYBRIDSHARD_CAUSE_WAIT", "1")
    assert causes.poll_every() == 0.4
    plane = ControlPlane(Store(), rank=1, world=4)
    fresh = [types.SimpleNamespace(started=time.monotonic())]
    waiting = [types.SimpleNamespace(started=time.monotonic() - causes.WATCH_AFTER - 1)]
    with bound(plane):
        causes.poll_if_waiting(None, fresh)
        assert Store.reads == 0  # not waiting long enough: a healthy step reads nothing
        for _ in range(20):  # the watchdog's polls within poll_every()
            causes.poll_if_waiting(None, waiting)
        assert Store.reads == 1
        plane.causes_polled -= causes.poll_every()
        causes.poll_if_waiting(None, waiting)
        assert Store.reads == 2


def test_fault_limits_from_the_environment_warn_once_on_a_bad_value(monkeypatch, caplog):
    from hybridshard.runtime.faults import causes, exits, mismatch, peers, watchdog

    monkeypatch.setattr(peers, "_WARNED", set())
    for name, read, default in [("HYBRIDSHARD_FAULT_SECONDS", watchdog.fault_seconds, 60.0),
                                ("HYBRIDSHARD_HANG_SECONDS", watchdog.hang_seconds, 300.0),
                                ("HYBRIDSHARD_MISMATCH_SECONDS", mismatch.mismatch_seconds, 30.0),
                                ("HYBRIDSHARD_CAUSE_WAIT", causes.wait_seconds, 5.0),
                                ("HYBRIDSHARD_EXIT_WAIT", exits.exit_wait_seconds, 10.0)]:
        monkeypatch.delenv(name, raising=False)
        assert read() == default, name
        monkeypatch.setenv(name, "2.5")
        assert read() == 2.5, name
        monkeypatch.setenv(name, "1m")
        with caplog.at_level("WARNING", logger="hybridshard.runtime.faults.peers"):
            caplog.clear()
            assert read() == default and read() == default, name
        assert [r.getMessage() for r in caplog.records] == [
            f"expected {name} to be a number of seconds, found '1m'; using {default:g}: set it to a number "
            "(0 turns the check off where that is documented) or unset it"], name


def test_a_rank_that_publishes_two_causes_counts_once_among_the_dying():
    """The raising rank stops waiting when every other rank kept its cause or is dying itself: a
    second cause from one rank must not count as a second dying rank."""
    import torch.distributed as dist

    from hybridshard.runtime.faults import causes
    from hybridshard.runtime.faults.rank_state import ControlPlane, bound

    store = dist.HashStore()
    for rank, texts in ((1, ["rank 1 raised A", "rank 1 raised B"]), (2, ["rank 2 raised C"])):
        with bound(ControlPlane(store, rank, 4)):
            for text in texts:
                causes.publish(text)
    assert int(store.add("hybridshard/causes", 0)) == 3
    assert int(store.add("hybridshard/causes/ranks", 0)) == 2
