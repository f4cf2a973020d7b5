"""A job-wide call made on some ranks only: found while every rank is alive, named on every rank.

[Note: entry point on some ranks only]
``if rank == 0: hs.full_state_dict(model)`` then ``dist.barrier()`` leaves every rank blocked, each
in a different collective, until the timeout; every rank is alive, so the fault check finds nothing.
So the watchdog thread follows the main thread ([Note: blocked in a collective] in
:mod:`hybridshard.runtime.trace.entry_points`), and

- once it is blocked for :func:`publish_seconds`, publishes a small record under
  ``hybridshard/blocked/<rank>`` (entry points, collective, the user's line, since when) and counts
  it; it clears both once it moves on: at most four writes per long wait;
- once blocked for :func:`mismatch_seconds` (``HYBRIDSHARD_MISMATCH_SECONDS``, 30 by default; <= 0:
  never), reads the count every :func:`check_every` seconds. Only when every rank has a record does
  rank 0 read them all; when all are blocked that long, some in an entry point and the others in a
  *different* call, and its next reading agrees, it writes that reading as the verdict. Each rank
  whose own record is still the one in the verdict votes for it; once all voted, every rank logs the
  same message, waits until all logged it and stops with status 1. A long wait costs a rank O(1)
  store ops per check, and the job one read of every record.

A rank outside any collective (computing, stalled) has no record, so a late rank is never reported.
Blocked times are compared as ``time.time()`` across hosts: clock skew shifts the limit.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from typing import Any, Callable

from hybridshard.runtime.faults import errors, peers
from hybridshard.runtime.faults.rank_state import current
from hybridshard.runtime.trace.entry_points import Blocked, MainThreadWatch

logger = logging.getLogger(__name__)

__all__ = ["MismatchWatch", "check_every", "mismatch_seconds", "publish_seconds"]

_DEFAULT_SECONDS = 30.0
_KEY = "hybridshard/blocked/{}"
_COUNT = "hybridshard/blocked"
"""How many ranks have a blocked record published now."""
_VERDICT = "hybridshard/mismatch/verdict"
_VOTES = "hybridshard/mismatch"


def mismatch_seconds() -> float:
    """How long every rank must be blocked before a mismatch is named (``HYBRIDSHARD_MISMATCH_SECONDS``)."""
    return peers.env_seconds("HYBRIDSHARD_MISMATCH_SECONDS", _DEFAULT_SECONDS)


def publish_seconds() -> float:
    """Blocked this long, a rank publishes where it is (5 s, less when the limit is lower)."""
    return min(5.0, mismatch_seconds() / 2)


def check_every() -> float:
    """Seconds between two readings of every rank's record while blocked past the limit."""
    # Two watchdog polls at least: a rank that moved on has cleared its record by the confirming reading.
    return max(1.0, min(5.0, mismatch_seconds() / 6))


def _record(state: Blocked) -> dict[str, Any]:
    return {"blocked": True, "entry": [[e.name, e.seq] for e in state.entries], "call": state.call,
            "at": state.at, "inner": state.inner, "since": state.since, "text": state.describe()}


def _identity(record: dict[str, Any]) -> tuple[str, int] | None:
    """The job-wide call a rank is in: its outermost entry point and that entry's number."""
    return tuple(record["entry"][0]) if record.get("entry") else None  # type: ignore[return-value]


class MismatchWatch:
    """The mismatch check of one rank, run by its watchdog thread once per poll."""

    def __init__(self, beat: Callable[[], None] = lambda: None) -> None:
        self.main = MainThreadWatch()
        self._beat = beat
        """This rank's heartbeat, kept while the watchdog thread waits for the votes."""
        self._published: float | None = None
        """``since`` of the blocked episode published, or ``None``."""
        self._next_check = 0.0
        self._seen: list[dict[str, Any]] | None = None
        self._voted: set[str] = set()

    def poll(self, pending: list[Any]) -> Blocked | None:
        """Look at the main thread, publish or read as the note says; stops the process on a mismatch."""
        if not current().watch_main:
            return None
        limit = mismatch_seconds()
        state = self.main.observe(pending)
        if limit <= 0 or state is None:
            return state
        s = peers.store()
        if s is None:
            return state
        me, world = peers.identity()
        now = time.time()
        blocked_for = now - state.since if state.blocked else 0.0
        try:
            if self._published is not None and (not state.blocked or state.since != self._published):
                s.set(_KEY.format(me), json.dumps({"blocked": False}).encode())
                s.add(_COUNT, -1)
                self._published, self._seen = None, None
            if state.blocked and self._published is None and blocked_for >= publish_seconds():
                s.set(_KEY.format(me), json.dumps(_record(state)).encode())
                s.add(_COUNT, 1)
                self._published = state.since
            if self._published is not None and blocked_for >= limit and time.monotonic() >= self._next_check:
                self._next_check = time.monotonic() + check_every()
                self._check(s, me, world, limit)
        except Exception:  # noqa: BLE001 - the store may be gone: the fault paths say so
            logger.debug("mismatch check failed", exc_info=True)
        return state

    def _check(self, s: Any, me: int, world: int, limit: float) -> None:
        if int(s.add(_COUNT, 0)) < world:
            self._seen = None
            return  # some rank has no record: it is running, so late at most
        if me == 0:
            found = self._read_all(s, world, limit)
            if found is not None:
                s.set(_VERDICT, json.dumps(found).encode())
        if not s.check([_VERDICT]):
            return
        records = json.loads(s.get(_VERDICT).decode())
        if len(records) != world or records[me].get("since") != self._published:
            return  # a verdict of an earlier wait, or this rank moved on since it was read: no vote
        self._stop(s, me, world, records, limit)

    def _read_all(self, s: Any, world: int, limit: float) -> list[dict[str, Any]] | None:
        """Every rank's record when they show a mismatch that the previous reading showed too."""
        keys = [_KEY.format(r) for r in range(world)]
        if not s.check(keys):
            return None
        records = [json.loads(v.decode()) for v in s.multi_get(keys)]
        now = time.time()
        if not all(r.get("blocked") and now - r["since"] >= limit for r in records):
            self._seen = None
            return None
        idents = [_identity(r) for r in records]
        if all(i is None for i in idents) or len(set(idents)) == 1:
            self._seen = None
            return None  # the same call everywhere (slow, or the others' business), or no entry point at all
        if self._seen is None or [r["since"] for r in self._seen] != [r["since"] for r in records]:
            self._seen = records  # confirmed at the next reading: no rank moved on in between
            return None
        return records

    def _stop(self, s: Any, me: int, world: int, records: list[dict[str, Any]], limit: float) -> None:
        """Stop once every rank has found the same mismatch: a rank that moved on, whose record another
        rank read before it was cleared (a starved watchdog thread), never agrees, so nobody stops."""
        reading = json.dumps([[_identity(r), r["since"]] for r in records]).encode()
        votes = f"{_VOTES}/{hashlib.sha1(reading).hexdigest()}"
        if votes not in self._voted:  # one vote per rank and reading, however often it is read
            self._voted.add(votes)
            s.add(votes, 1)
        deadline = time.monotonic() + 2 * check_every() + peers.REPORT_SECONDS
        while int(s.add(votes, 0)) < world:
            if time.monotonic() > deadline:
                logger.debug("mismatch not confirmed by every rank; watching on")
                self._seen = None
                return
            self._beat()  # a rank waiting here is alive: its peers' fault checks must see it beat
            time.sleep(0.1)
        message = describe(me, records, limit)
        logger.critical("%s", message)
        errors.write_error_file(errors.CollectiveError(message), consequence=False)
        peers.publish("failed", f"rank {me} stopped: {errors.first_line(message)}")
        s.add(f"{votes}/logged", 1)
        deadline = time.monotonic() + peers.REPORT_SECONDS
        while time.monotonic() < deadline and int(s.add(f"{votes}/logged", 0)) < world:
            # Every rank logs before any leaves (its exit fails the others' collectives); then all leave at once.
            self._beat()
            time.sleep(0.05)
        errors.stop_now(1)


def describe(me: int, records: list[dict[str, Any]], limit: float) -> str:
    """The message every rank stops with: the call, the ranks in it, the others and where they are."""
    idents = [_identity(r) for r in records]
    call = min((i for i in idents if i is not None), key=lambda i: (i[1], i[0]))
    inside = [r for r, i in enumerate(idents) if i == call]
    elsewhere: dict[str, list[int]] = {}
    for r, i in enumerate(idents):
        if i != call:
            elsewhere.setdefault(_short_call(records[r]), []).append(r)
    others = "; ".join(f"{_ranks(rs)} {'is' if len(rs) == 1 else 'are'} blocked in {where}"
                       for where, rs in elsewhere.items())
    if all(i is not None and i[0] == call[0] for i in idents):  # every rank in it, some one call further
        by_call: dict[int, list[int]] = {}
        for r, i in enumerate(idents):
            by_call.setdefault(i[1], []).append(r)  # type: ignore[index]
        at = "; ".join(f"{_ranks(rs)} {'is' if len(rs) == 1 else 'are'} in call #{n}" for n, rs in sorted(by_call.items()))
        first = (f"{call[0]} must be called the same number of times on every rank, but {at}, every rank blocked "
                 f"for over {limit:.0f}s (HYBRIDSHARD_MISMATCH_SECONDS): call {call[0]} as often on every rank "
                 "(not once more under `if rank == 0:`), in the same order as the other collectives.")
    else:
        first = (f"{call[0]} must be called on every rank, but only {_ranks(inside)} entered it (call "
                 f"#{call[1]}), while {others}, every rank for over {limit:.0f}s (HYBRIDSHARD_MISMATCH_SECONDS): call "
                 f"{call[0]} on every rank (not under `if rank == 0:`), in the same order as the other collectives.")
    now = time.time()
    rows = "\n".join(f"  rank {r}: {rec['text']}, for {now - rec['since']:.0f}s" for r, rec in enumerate(records))
    return (f"{first}\nwhere every rank is:\n{rows}\nEvery rank stops now (rank {me} too) rather than at the process "
            f"group's timeout.\n{errors.RESTART}")


def _ranks(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _short_call(record: dict[str, Any]) -> str:
    entry = f"{record['entry'][0][0]} (call #{record['entry'][0][1]}), " if record.get("entry") else ""
    return f"{entry}{record['call']} at {record['at']}"
