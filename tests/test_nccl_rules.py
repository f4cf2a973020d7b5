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

        def published(kind, ranks):
            finished = asks["n"] >= len(peer_seconds)
            done = {0: "rank 0 finished after 3 steps", **({1: "rank 1 finished after 3 steps"} if finished else {})}
            return done if kind == "done" else {}

        def ask(mine, seconds=2.0):
            s = peer_seconds[min(asks["n"], len(peer_seconds) - 1)]
            asks["n"] += 1
            return [peers.Report(0, "running", "rank 0: exiting"),
                    peers.Report(1, "collective", "rank 1: in all_reduce on world", (0, 1), "", s)]

        monkeypatch.setattr(peers, "published", published)
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
