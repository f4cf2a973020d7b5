"""Defects of the GPU path that need no emulated stream to show: each test failed before its fix."""

from __future__ import annotations

import pytest


class _Stopped(Exception):
    """What the faked ``errors.stop_now`` raises instead of ending the process."""


@pytest.fixture
def exiting(monkeypatch):
    """``exits._at_exit`` of rank 0 of 2 after 3 steps, with the store and the peers faked."""
    from hybridshard.runtime.faults import errors, exits, peers
    from hybridshard.runtime.faults.rank_state import current
    from hybridshard.runtime.trace.position import where

    monkeypatch.setattr(where, "step", 3)
    monkeypatch.setattr(current(), "raised", False)
    monkeypatch.setattr(peers, "store", lambda: object())
    monkeypatch.setattr(peers, "identity", lambda: (0, 2))
    monkeypatch.setattr(peers, "publish", lambda kind, text: None)
    monkeypatch.setattr(exits, "exit_wait_seconds", lambda: 30.0)
    monkeypatch.setattr(exits.time, "sleep", lambda s: None)
    stops: list[int] = []

    def stop_now(code: int) -> None:
        stops.append(code)
        raise _Stopped

    monkeypatch.setattr(errors, "stop_now", stop_now)

    def run(peer_seconds: list[float]) -> tuple[list[int], int]:
        """Rank 1 answers "in a collective for s seconds" for each s, then says it finished."""
        asks = {"n": 0}

        def tally(name, add=0):
            finished = asks["n"] >= len(peer_seconds)
            return 0 if name == "raised" else 2 if finished else 1  # "done" and "done-after-3" alike

        def ask(mine, seconds=2.0):
            s = peer_seconds[min(asks["n"], len(peer_seconds) - 1)]
            asks["n"] += 1
            return [peers.Report(0, "running", "rank 0: exiting"),
                    peers.Report(1, "collective", "rank 1: in all_reduce on world", (0, 1), "", s)]

        monkeypatch.setattr(peers, "tally", tally)
        monkeypatch.setattr(peers, "ask_everyone", ask)
        try:
            exits._at_exit()
        except _Stopped:
            pass
        return stops, asks["n"]

    return run


def test_exit_waits_for_a_peer_whose_gpu_is_finishing_the_last_step(exiting):
    """On NCCL the peer's last collective stays registered until its GPU ran it: not a blocked peer."""
    stops, asks = exiting([0.01, 0.4, 0.9])
    assert stops == [] and asks == 3


def test_exit_still_leaves_when_a_peer_is_blocked_waiting_for_it(exiting):
    stops, _ = exiting([0.5, 3.5, 4.0])
    assert stops == [1]


class _CountingStore:
    """The calls of a c10d store that a rank's exit makes, counted by name, over a dict."""

    def __init__(self, data: dict[str, bytes | int]) -> None:
        self.data, self.calls, self.added = dict(data), [], []

    def set(self, key, value):
        self.calls.append("set")
        self.data[key] = value if isinstance(value, bytes) else str(value).encode()

    def add(self, key, n):
        self.calls.append("add")
        self.added.append((key, n))
        self.data[key] = int(self.data.get(key, 0)) + n
        return self.data[key]

    def check(self, keys):
        self.calls.append("check")
        return all(k in self.data for k in keys)

    def multi_get(self, keys):
        self.calls.append("multi_get")
        return [self.data[k] for k in keys]


def _exit_rank0_of_4(monkeypatch, store: _CountingStore) -> list[int]:
    """Rank 0 of 4 exits after 3 steps over ``store``; the statuses it stopped with."""
    from hybridshard.runtime.faults import errors, exits, peers
    from hybridshard.runtime.faults.rank_state import current
    from hybridshard.runtime.trace.position import where

    monkeypatch.setattr(where, "step", 3)
    monkeypatch.setattr(current(), "raised", False)
    monkeypatch.setattr(current(), "final", None)
    monkeypatch.setattr(peers, "store", lambda: store)
    monkeypatch.setattr(peers, "identity", lambda: (0, 4))
    monkeypatch.setattr(exits, "exit_wait_seconds", lambda: 30.0)
    stops: list[int] = []

    def stop_now(code: int) -> None:
        stops.append(code)
        raise _Stopped

    monkeypatch.setattr(errors, "stop_now", stop_now)
    try:
        exits._at_exit()
    except _Stopped:
        pass
    return stops


def _beats(steps: dict[int, int]) -> dict[str, bytes]:
    return {f"hybridshard/beat/{r}": f'9|{{"state": "done", "text": "rank {r} finished after {n} steps"}}'.encode()
            for r, n in steps.items()}


@pytest.mark.parametrize("others_after", [3, 2])
def test_a_finished_rank_reads_no_heartbeat_unless_the_counts_disagree(monkeypatch, others_after):
    """Rank 0 of 4 exits after 3 steps, the other three finished after ``others_after``: with the same
    steps, its exit costs a few counts (no heartbeat read: W keys on each of W ranks at scale); with
    different steps it reads the heartbeats once to name them, and stops with status 1."""
    store = _CountingStore({**_beats({1: others_after, 2: others_after, 3: others_after}),
                            "hybridshard/tally/done": 3, f"hybridshard/tally/done-after-{others_after}": 3})
    stops = _exit_rank0_of_4(monkeypatch, store)
    if others_after == 3:
        assert stops == [] and store.calls == ["add", "set", "add", "add", "add", "add"], store.calls
    else:
        assert stops == [1] and store.calls.count("multi_get") == 1, store.calls


def test_a_rank_counts_its_steps_before_it_counts_itself_done(monkeypatch):
    """A rank read as done must already be counted under its steps, or a peer looking between its two
    additions sees one rank fewer after its steps than done and stops a job whose ranks all agree."""
    store = _CountingStore({**_beats({1: 3, 2: 3, 3: 3}), "hybridshard/tally/done": 3,
                            "hybridshard/tally/done-after-3": 3})
    assert _exit_rank0_of_4(monkeypatch, store) == []
    mine = [key for key, n in store.added if n == 1]
    assert mine == ["hybridshard/tally/done-after-3", "hybridshard/tally/done"], store.added


def test_counts_caught_between_a_peers_two_additions_stop_no_one(monkeypatch):
    """The counts say one rank fewer finished after these steps than finished (a peer between its two
    additions, or a count that drifted): the heartbeats, all after 3 steps, have the last word."""
    store = _CountingStore({**_beats({1: 3, 2: 3, 3: 3}), "hybridshard/tally/done": 3,
                            "hybridshard/tally/done-after-3": 2})
    calls = {"n": 0}
    add = store.add

    def settling_add(key, n):  # the peer's missing addition lands after rank 0's first look
        calls["n"] += 1
        if calls["n"] == 6:
            store.data["hybridshard/tally/done-after-3"] = int(store.data["hybridshard/tally/done-after-3"]) + 1
        return add(key, n)

    store.add = settling_add
    from hybridshard.runtime.faults import peers
    monkeypatch.setattr(peers, "ask_everyone", lambda mine, seconds=2.0: [])
    assert _exit_rank0_of_4(monkeypatch, store) == []
    assert store.calls.count("multi_get") == 1, store.calls
