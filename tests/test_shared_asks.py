"""Ranks that ask at the same time share one reading of the heartbeats ([Note: one reading for the
ranks asking at once] in hybridshard/runtime/faults/asks.py): ranks as threads of this process, each
with its own control plane, on one in-memory store that counts what each rank asks of it."""

from __future__ import annotations

import re
import threading
import time
from collections import Counter

import pytest

from hybridshard.runtime.faults import asks, peers
from hybridshard.runtime.faults.rank_state import ControlPlane, bound

WORLD = 32


class Store:
    """The calls of a c10d store that the fault check makes, on one dict, counted per rank and name."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}
        self.lock = threading.Lock()
        self.ops: dict[int, Counter] = {}

    def client(self, rank: int) -> "Client":
        self.ops[rank] = Counter()
        return Client(self, rank)


class Client:
    def __init__(self, store: Store, rank: int) -> None:
        self.store, self.ops = store, store.ops[rank]

    def set(self, key, value):
        with self.store.lock:
            self.ops["set/beat" if key.startswith("hybridshard/beat/") else "set"] += 1
            self.store.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def check(self, keys):
        with self.store.lock:
            self.ops["check"] += 1
            return all(k in self.store.data for k in keys)

    def multi_get(self, keys):
        with self.store.lock:
            self.ops["multi_get"] += 1
            self.ops["keys read"] += len(keys)
            return [self.store.data[k] for k in keys]

    def get(self, key):
        with self.store.lock:
            self.ops["get"] += 1
            return self.store.data[key]

    def compare_set(self, key, expected, desired):  # c10d's semantics, missing keys included
        with self.store.lock:
            self.ops["compare_set"] += 1
            have = self.store.data.get(key)
            if have is None:
                if expected:
                    return expected
                self.store.data[key] = desired
                return desired
            if have == expected:
                self.store.data[key] = desired
                return desired
            return have


class Job:
    """WORLD ranks beating every 0.3 s (the silent ones: never after their first beat)."""

    def __init__(self, silent=()) -> None:
        self.store = Store()
        self.planes = [ControlPlane(self.store.client(r), r, WORLD) for r in range(WORLD)]
        self.stop = threading.Event()
        self.silent = set(silent)
        for r in range(WORLD):
            self._beat(r)
        self.threads = [threading.Thread(target=self._run, args=(r,), daemon=True) for r in range(WORLD)
                        if r not in self.silent]
        for t in self.threads:
            t.start()

    def status(self, r):
        return {"state": "collective", "ranks": list(range(WORLD)), "call": "",
                "text": f"rank {r}: in all_reduce of 4 elements on the world group (ranks [0, 1, ..., {WORLD - 1}]) "
                        f"for {61 + r % 3}s, step 7", "seconds": 61.0 + r % 3}

    def _beat(self, r):
        with bound(self.planes[r]):
            peers.beat(self.status(r))

    def _run(self, r):
        while not self.stop.wait(0.3):
            self._beat(r)

    def ask_all(self, ranks, **kwargs):
        out, spent = {}, {}

        def ask(r):
            t = time.monotonic()
            with bound(self.planes[r]):
                out[r] = peers.ask_everyone(self.status(r), **kwargs)
            spent[r] = time.monotonic() - t

        threads = [threading.Thread(target=ask, args=(r,)) for r in ranks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return out, spent

    def ops(self, name):
        return sum(c[name] for c in self.store.ops.values())

    def close(self):
        self.stop.set()


@pytest.fixture
def job_with_a_silent_rank():
    job = Job(silent={9})
    yield job
    job.close()


def test_every_rank_asking_at_once_shares_one_reading(job_with_a_silent_rank):
    job = job_with_a_silent_rank
    before = {k: job.ops(k) for k in ("multi_get", "keys read", "check")}
    askers = [r for r in range(WORLD) if r != 9]
    out, spent = job.ask_all(askers, brief=True)
    # One round: its leader reads every heartbeat (one check, a multi_get now and at the deadline);
    # every other asker reads one key a look. Asking alone, each rank made 2 multi_gets of ~W keys.
    assert job.ops("multi_get") - before["multi_get"] <= 3, job.store.ops
    assert job.ops("keys read") - before["keys read"] <= 2 * WORLD + 2, job.store.ops
    for r in askers:
        assert [(x.rank, x.state) for x in out[r]] == [(9, "lost")], (r, out[r])  # only its own counter stood still
        assert spent[r] < peers.REPORT_SECONDS + 2 * asks.FOLLOW_EVERY + 1.0, spent  # the round, and a look
        mine = job.store.ops[r]
        assert sum(v for k, v in mine.items() if k not in ("set/beat", "keys read")) <= 10, (r, mine)
    assert len([r for r in askers if job.store.ops[r]["multi_get"]]) == 1, job.store.ops  # one leader


def test_a_full_round_gives_every_rank_each_report_and_the_table_runs(job_with_a_silent_rank):
    job = job_with_a_silent_rank
    out, _ = job.ask_all(range(0, WORLD, 2))  # 16 askers, the full report
    for r, reports in out.items():
        assert [x.rank for x in reports] == list(range(WORLD)), reports
        assert reports[9].state == "lost" and reports[9].text.startswith("rank 9: no answer within 3s"), reports[9]
        mine = reports[r]
        assert mine.text == job.status(r)["text"] and list(mine.ranks) == list(range(WORLD)), mine  # its own answer, exact
        o = 11 if r == 10 else 10
        other = reports[o]
        assert other.state == "collective" and other.text.startswith(f"rank {o}: in all_reduce"), other
        assert other.ranks == range(WORLD), other
    lines = peers.table(out[0]).splitlines()
    assert lines == [f"  collective  ranks 0-8: in all_reduce of 4 elements on the world group (ranks [0, 1, ..., "
                     f"{WORLD - 1}]) for 61-63s, step 7",
                     "        lost  rank 9: no answer within 3s (killed, crashed or hung)",
                     f"  collective  ranks 10-{WORLD - 1}: in all_reduce of 4 elements on the world group (ranks [0, "
                     f"1, ..., {WORLD - 1}]) for 61-63s, step 7"], lines


def test_a_round_whose_leader_stalled_is_left_after_a_bound():
    job = Job()
    try:
        series = "hybridshard/ask/brief-1.5"
        job.store.data[f"{series}/round"] = b"1|open|20"  # rank 20 claimed and never published
        out, spent = job.ask_all(range(8), brief=True, seconds=1.5)
        for r in range(8):
            assert out[r] == [], (r, out[r])  # every rank alive
        # Each waited for the stalled round, then one of them led round 2 and the others followed it.
        assert max(spent.values()) < 1.5 + asks.follow_slack(1.5) + peers.FIRST_READ + 3.0, spent
        assert min(spent.values()) >= 1.5 + asks.follow_slack(1.5) - 0.1, spent
        assert job.ops("multi_get") <= 3 and job.store.data[f"{series}/round"].startswith(b"2|closed|"), job.store.ops
    finally:
        job.close()


def test_a_store_gone_mid_round_ends_the_ask_with_none():
    job = Job()
    try:
        def gone(*args):
            raise RuntimeError("Connection reset by peer")

        for plane in job.planes[:4]:
            plane.found["store"].compare_set = gone
        out, spent = job.ask_all(range(4), brief=True)
        assert out == {r: None for r in range(4)} and max(spent.values()) < 1.0, (out, spent)
    finally:
        job.close()


def test_compact_runs_expand_to_the_same_reports():
    reports = [peers.Report(r, "failed", f"rank {r} stopped: rank 12 was lost; so all_reduce failed on rank {r} (step 3)")
               for r in range(12)] + [peers.lost_report(12, 9.0)] + [
        peers.Report(r, "collective", f"rank {r}: in all_gather of 8 elements on the shard group (ranks [{r - r % 2}, "
                     f"{r - r % 2 + 1}]) for 70s, step 3", (r - r % 2, r - r % 2 + 1), "save_checkpoint", 70.2)
        for r in range(13, 16)]
    entries = asks.compact(reports)
    assert len(entries) == 1 + 1 + 1 + 1, entries  # the 12 failed ranks are one run, 14-15 another (their group)

    def fields(r):
        return r.rank, r.state, r.text, list(r.ranks), r.call, r.seconds

    assert [fields(r) for r in asks.expand(entries)] == [fields(r) for r in reports], entries
    lines = peers.table(reports).splitlines()
    assert lines[0] == "      failed  ranks 0-11 stopped: rank 12 was lost; so all_reduce failed on rank r (step 3)", lines
    assert len(lines) == 1 + 1 + 3, lines  # runs shorter than RUN_LINE stay one line a rank


def test_expanded_reports_carry_the_key_their_text_gives():
    """A follower's reports come with the key a table groups them by (computing it is two regular
    expressions a report: W of them on every survivor at once); it must be the key their own text
    gives, or a follower's table would group ranks the leader's would not."""
    reports = [peers.Report(r, "collective", f"rank {r}: in all_reduce on world (ranks 0-{r % 3}) for {9 + r}s, rank {r} "
                            f"step 3", range(0, 40), "", 9.0 + r) for r in range(1, 40)]
    reports += [peers.Report(40 + r, "collective", f"rank {40 + r}: in all_gather on the shard group (ranks [{r}, 44])"
                             f" for 5s", (r, 44), "save_checkpoint", 5.0) for r in range(4)]
    reports.append(peers.Report(44, "raised", "rank 44 raised ValueError: rank 7 sent a batch of 3, expected 4"))
    expanded = asks.expand(asks.compact(reports))
    carried = [r.like for r in expanded]
    assert all(carried), carried
    for r in expanded:
        r.like = ()
    assert [asks._key(r) for r in expanded] == carried
    assert peers.table(expanded) == peers.table(asks.expand(asks.compact(reports)))


def _outcome_made_one_by_one(value, me, world, mine, seconds, brief):
    """A round's outcome as a list of every rank's report, each made (the reference for :class:`asks.Reports`)."""
    import json

    from hybridshard.runtime.faults.rank_state import current

    body = json.loads(value)
    lost = {r for lo, hi in body["lost"] for r in range(lo, hi)} - {me}
    given = {r.rank: r for r in asks.expand(body["reports"])}
    out = []
    for r in range(world):
        if r in lost:
            out.append(peers.lost_report(r, seconds))
        elif r == me:
            if brief:
                continue
            if current().final is None or r not in given:
                out.append(peers.Report(r, mine["state"], mine["text"], tuple(mine.get("ranks", ())),
                                        mine.get("call", ""), float(mine.get("seconds", 0.0))))
            else:
                out.append(given[r])
        elif r in given:
            out.append(given[r])
    return out


@pytest.mark.parametrize("me", [0, 3, 11, 12, 17, 39])
@pytest.mark.parametrize("brief", [False, True])
@pytest.mark.parametrize("final", [None, {"state": "failed", "text": "rank x stopped"}])
def test_a_followers_reports_read_from_runs_are_the_reports_made_one_by_one(me, brief, final):
    """What a follower reads from its round's runs (iteration, indexing, :func:`asks.having`, the
    table) equals what making every rank's report gives, wherever its own rank falls: first, inside or
    at the edge of a run, lost, alone in one."""
    world = 40
    reports = [peers.Report(r, "collective", f"rank {r}: in all_reduce on world (ranks 0-39) for {9 + r % 2}s, step 3",
                            range(40),
                            "", 9.0 + r % 2) for r in range(0, 12)]
    reports += [peers.Report(r, "failed", f"rank {r} stopped: rank 12 was lost", (), "", 0.0) for r in range(13, 17)]
    reports.append(peers.Report(17, "raised", "rank 17 raised ValueError: bad batch"))
    reports += [peers.Report(r, "done", f"rank {r} finished after 3 steps") for r in range(18, 39)]
    body = {"lost": peers.runs([12, 39]), "reports": asks.compact(reports)}
    value = __import__("json").dumps(body, separators=(",", ":")).encode()
    mine = {"state": "collective", "text": f"rank {me}: in all_reduce on world (ranks 0-39) for 9s, mine",
            "ranks": list(range(40)), "seconds": 9.0}
    plane = ControlPlane(object(), me, world)
    plane.final = final
    with bound(plane):
        got = asks._outcome(value, me, world, mine, 9.0, brief)
        want = _outcome_made_one_by_one(value, me, world, mine, 9.0, brief)
        tables = peers.table(asks._outcome(value, me, world, mine, 9.0, brief)), peers.table(want)

    def fields(r):
        return r.rank, r.state, r.text, list(r.ranks), r.call, r.seconds

    assert isinstance(got, asks.Reports) and len(got) == len(want)
    assert [fields(r) for r in got] == [fields(r) for r in want]
    assert fields(got[len(want) // 2]) == fields(want[len(want) // 2])
    for states in (("lost",), ("raised", "done"), ("raised", "failed", "done", "lost"), ("collective",)):
        assert [fields(r) for r in peers.having(got, states)] == [fields(r) for r in want if r.state in states]
    assert tables[0] == tables[1], tables
    present = {r.rank: r.state for r in want}
    for line in tables[0].splitlines():  # a line for a run covers ranks that are all there, all alike
        state, _, text = line.strip().partition("  ")
        run = re.match(r"ranks (\d+)-(\d+)", text.strip())
        if run:
            assert all(present.get(r) == state for r in range(int(run[1]), int(run[2]) + 1)), (line, tables[0])
