"""One reading of every heartbeat for all the ranks that ask at the same time, and reports in runs.

[Note: one reading for the ranks asking at once]
A stall that pushes every rank past ``HYBRIDSHARD_FAULT_SECONDS`` at once, or a collective failing on
every survivor, made each rank read every heartbeat: W² bytes through the store's host. Now askers
share rounds, one series per kind of ask (brief or full, its ``seconds``): ``.../round`` holds
``<n>|open|<rank>`` or ``<n>|closed|<rank>``. An asker swaps the value it saw last for
``<n+1>|open|<me>`` (``compare_set``); if that lands it leads: it reads as
:func:`~hybridshard.runtime.faults.peers.observe` always did (lost only when a rank's own counter stood
still), closes the round just before its second reading and leaves a compact outcome under ``.../<n+1>``.
An asker that finds a round open follows it, polling the outcome key (one op a look); one that finds
it closed starts the next. A follower's round began at most ``FIRST_READ`` before it asked. A leader
that dies or stalls leaves its followers ``seconds`` + :func:`follow_slack`; they start the next round,
and after :data:`MAX_FOLLOWS` rounds without an outcome read every heartbeat themselves. An unreachable
store ends the ask with ``None`` at once.
The outcome holds the lost ranks as runs and the others' reports as runs of consecutive ranks alike
but for their own number and seconds in flight (:func:`compact`): a brief round only the ranks that
raised, failed or finished; a full one every rank, so the hang report and the exit check get a report
per rank back (its run's least seconds). Tables print a run of :data:`RUN_LINE` or more as one line
(:func:`table`): a 4,096-rank job waiting on one rank logs a few lines, not 4,096. docs/scale.md.
"""

from __future__ import annotations

import json
import logging
import re
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Callable

from hybridshard.runtime.faults import peers
from hybridshard.runtime.faults.peers import Report
from hybridshard.runtime.faults.rank_state import current

logger = logging.getLogger(__name__)

__all__ = ["MAX_FOLLOWS", "RUN_LINE", "Reports", "compact", "expand", "follow_slack", "having", "shared", "table"]

MAX_FOLLOWS = 2
"""Rounds an asker follows without an outcome before it reads every heartbeat itself."""
RUN_LINE = 5
"""A run of this many ranks or more with the same report prints as one line."""
FOLLOW_EVERY = 0.5
"""A follower looks for its round's outcome this often while the round's second reading may still
be due (up to 1.5 s after it joined: the round leader reads again :data:`~hybridshard.runtime.faults.peers.FIRST_READ`
after its first reading, which came before the follower joined), then from shortly before the round's
``seconds`` end on, 1.5 times longer each time."""
_PREFIX = "hybridshard/ask"
_ABSENT = b"\x00absent"
_ATTEMPTS = 6
_SECONDS = re.compile(r"( for )(\d+)(s, )")
_RANK = re.compile(r"\brank (\d+)\b")


def follow_slack(seconds: float) -> float:
    """How much longer than ``seconds`` a follower waits for its leader's outcome."""
    return max(2.0, seconds)


def _series(seconds: float, brief: bool) -> str:
    return f"{_PREFIX}/{'brief' if brief else 'full'}-{seconds:g}"


def _parse(value: bytes) -> tuple[int, str, int]:
    """``(round, "open" | "closed", its leader)`` from the round key's value; ``(0, "", -1)`` for none."""
    if not value:
        return 0, "", -1
    n, phase, leader = value.decode().split("|")
    return int(n), phase, int(leader)


def shared(s: Any, me: int, world: int, mine: dict[str, Any], seconds: float,
           while_waiting: Callable[[], None] | None, brief: bool) -> list[Report]:
    """:func:`~hybridshard.runtime.faults.peers.ask_everyone`'s reading, shared with the ranks asking at
    the same time (see the note). Raises when the store cannot be reached."""
    series = _series(seconds, brief)
    key = f"{series}/round"
    seen_last = current().found.setdefault("asks", {})
    last, follows = seen_last.get(series, b""), 0
    for _ in range(_ATTEMPTS):
        n = _parse(last)[0]
        claim = f"{n + 1}|open|{me}".encode()
        got = s.compare_set(key, last, claim)
        if got == claim:
            seen_last[series] = claim
            return _lead(s, key, f"{series}/{n + 1}", claim, me, world, mine, seconds, while_waiting, brief)
        if got == last:  # expected a value that is not there (a new store): claim from nothing
            last = b""
            continue
        seen_last[series] = last = got
        m, phase, leader = _parse(got)
        if phase == "open" and leader != me and follows < MAX_FOLLOWS:
            follows += 1
            out = _follow(s, f"{series}/{m}", me, world, mine, seconds, while_waiting, brief)
            if out is not None:
                return out
            # Its leader died or stalled: the next attempt starts round m+1 (or follows whoever did).
    seen, lost = peers.observe(s, me, world, seconds, while_waiting)
    return peers.reports(me, world, mine, seen, lost, seconds, brief)


def _lead(s: Any, key: str, outcome_key: str, claim: bytes, me: int, world: int, mine: dict[str, Any],
          seconds: float, while_waiting: Callable[[], None] | None, brief: bool) -> list[Report]:
    closed = claim.replace(b"|open|", b"|closed|")
    done = []

    def close() -> None:  # a follower that gave up on this round may have started the next: leave that
        s.compare_set(key, claim, closed)
        done.append(True)

    seen, lost = peers.observe(s, me, world, seconds, while_waiting, on_reread=close)
    if not done:
        close()
    given = peers.reports(me, world, mine, seen, lost, seconds, brief, with_me=True)
    body = {"lost": peers.runs(sorted(lost)), "reports": compact([r for r in given if r.rank not in lost])}
    s.set(outcome_key, json.dumps(body, separators=(",", ":")).encode())
    return [r for r in given if not (brief and r.rank == me)]


def _follow(s: Any, outcome_key: str, me: int, world: int, mine: dict[str, Any], seconds: float,
            while_waiting: Callable[[], None] | None, brief: bool) -> list[Report] | None:
    """The outcome of the round under ``outcome_key`` as this rank's reports; ``None`` when its leader
    left none within ``seconds`` + :func:`follow_slack`."""
    start = time.monotonic()
    deadline, looks = start + seconds + follow_slack(seconds), 0
    next_look = start + FOLLOW_EVERY
    while True:
        if while_waiting is not None:
            while_waiting()
        time.sleep(max(0.01, min(0.25, next_look - time.monotonic())))  # see [Note: few wake-ups]
        if time.monotonic() < next_look:
            continue
        value = s.compare_set(outcome_key, _ABSENT, _ABSENT)  # one operation; no wait for a missing key
        if value != _ABSENT:
            return _outcome(value, me, world, mine, seconds, brief)
        if time.monotonic() >= deadline:
            logger.debug("no outcome under %s within %.0fs: its leader left or stalled", outcome_key,
                         time.monotonic() - start)
            return None
        looks += 1
        next_look = time.monotonic() + FOLLOW_EVERY * 1.5 ** max(0, looks - 5)
        if looks == 3:  # not within the second reading: a counter stood still, the round ends near `seconds`
            next_look = max(next_look, start + seconds - peers.FIRST_READ + FOLLOW_EVERY)
        next_look = min(next_look, deadline)


def _outcome(value: bytes, me: int, world: int, mine: dict[str, Any], seconds: float, brief: bool) -> Reports:
    """A round's outcome as this rank's reports: the lost ranks, the leader's runs, and this rank's own
    answer in place of its run's (unless it published its end: then the run's; ``brief``: none)."""
    body = json.loads(value)
    parts: list[tuple[int, int, Any]] = [(r, r + 1, peers.lost_report(r, seconds))
                                         for lo, hi in body["lost"] for r in range(lo, hi) if r != me]
    final, entries = current().final, body["reports"]
    keep_mine = not brief and final is not None and any(e[0] <= me < e[1] for e in entries)
    for entry in entries:
        lo, hi = entry[0], entry[1]
        if keep_mine or not lo <= me < hi:
            parts.append((lo, hi, entry))
            continue
        parts += [(a, b, entry) for a, b in ((lo, me), (me + 1, hi)) if a < b]
    if not brief and not keep_mine:
        parts.append((me, me + 1, Report(me, mine["state"], mine["text"], tuple(mine.get("ranks", ())),
                                         mine.get("call", ""), float(mine.get("seconds", 0.0)))))
    return Reports(sorted(parts, key=lambda part: part[0]))


class Reports(Sequence[Report]):
    """One :class:`Report` per rank, in rank order, kept as a round's outcome gave them: runs of ranks
    alike, made into reports only when read one by one. [Note: a follower's reports] Every survivor of a
    failure follows the same round, and making its W reports was most of its work (W of them on each of W
    ranks); :func:`having` and :func:`table` read the runs instead, so a follower's message costs a scan
    of the runs."""

    def __init__(self, parts: list[tuple[int, int, Any]]) -> None:
        self._parts = parts
        """``(first rank, stop, a Report)`` for one rank, ``(first rank, stop, an entry of compact())`` for a run."""
        self._made: list[Report] | None = None

    def __len__(self) -> int:
        return sum(hi - lo for lo, hi, _ in self._parts)

    def __iter__(self) -> Iterator[Report]:
        if self._made is not None:
            return iter(self._made)
        return (r for lo, hi, part in self._parts for r in _made(lo, hi, part))

    def __getitem__(self, index: Any) -> Any:
        if self._made is None:
            self._made = list(iter(self))
        return self._made[index]

    def __eq__(self, other: object) -> bool:
        return list(self) == list(other) if isinstance(other, (list, Reports)) else NotImplemented

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Reports({list(self)!r})"

    def having(self, states: Iterable[str]) -> list[Report]:
        states = set(states)
        return [r for lo, hi, part in self._parts if _state(part) in states for r in _made(lo, hi, part)]

    def segments(self) -> list[tuple[int, int, tuple[Any, ...], set[str], Any]]:
        """``(first rank, stop, key, its seconds as printed, the part)`` per part, for :func:`table`."""
        out = []
        for lo, hi, part in self._parts:
            if isinstance(part, Report):
                out.append((lo, hi, _key(part), {f"{part.seconds:.0f}"}, part))
            else:
                out.append((lo, hi, _entry_key(part), {f"{part[6]:.0f}"}, part))
        return out


def _state(part: Any) -> str:
    return part.state if isinstance(part, Report) else part[2]


def _made(lo: int, hi: int, part: Any) -> list[Report]:
    """The reports of ranks ``lo``..``hi - 1`` of one part of :class:`Reports`."""
    return [part] if isinstance(part, Report) else expand([[lo, hi, *part[2:]]])


def having(reports: Iterable[Report], states: Iterable[str]) -> list[Report]:
    """The reports in one of ``states``, in rank order; from the runs of a round's :class:`Reports`."""
    if isinstance(reports, Reports):
        return reports.having(states)
    states = set(states)
    return [r for r in reports if r.state in states]


# -- reports in runs --------------------------------------------------------------------------------


def _template(r: Report) -> str:
    """``r.text`` with its own rank number as ``\\x01`` and its seconds in flight as ``\\x00``."""
    own = str(r.rank)
    text = _RANK.sub(lambda m: "rank \x01" if m.group(1) == own else m.group(0), r.text)
    return _SECONDS.sub("\\g<1>\x00\\g<3>", text, count=1)


def _spans(ranks: Any) -> list[list[int]]:
    """A group as ``[start, stop)`` runs; a ``range`` (a heartbeat's contiguous group) without a walk."""
    if isinstance(ranks, range) and ranks.step == 1:
        return [[ranks.start, ranks.stop]] if len(ranks) else []
    return peers.runs(list(ranks))


def _key(r: Report) -> tuple[Any, ...]:
    if not r.like:
        r.like = (r.state, _template(r), r.call, tuple(map(tuple, _spans(r.ranks))))
    return r.like


def _runs_of(reports: list[Report]) -> list[list[Report]]:
    """``reports`` (by rank) cut into runs of consecutive ranks with the same :func:`_key`."""
    out: list[list[Report]] = []
    last: tuple[Any, ...] = ()
    for r in reports:
        key = _key(r)
        if out and out[-1][-1].rank + 1 == r.rank and key == last:
            out[-1].append(r)
        else:
            out.append([r])
        last = key
    return out


def _entry_key(entry: list[Any]) -> tuple[Any, ...]:
    """:func:`_key` of every report of a :func:`compact` entry."""
    return entry[2], entry[3], entry[4], tuple(map(tuple, entry[5]))


def compact(reports: list[Report]) -> list[list[Any]]:
    """``reports`` as runs: ``[first rank, stop, state, template, call, group runs, least s, most s]``."""
    out = []
    for run in _runs_of(reports):
        head = run[0]
        secs = [r.seconds for r in run]
        out.append([head.rank, run[-1].rank + 1, head.state, _template(head), head.call,
                    _spans(head.ranks), min(secs), max(secs)])
    return out


def expand(entries: list[list[Any]]) -> list[Report]:
    """:func:`compact`'s runs back as one :class:`Report` per rank (each with its run's least seconds)."""
    out = []
    for lo, hi, state, template, call, spans, least, _ in entries:
        ranks: Any = range(*spans[0]) if len(spans) == 1 else tuple(r for a, b in spans for r in range(a, b))
        text = template.replace("\x00", f"{least:.0f}")
        like = _entry_key([lo, hi, state, template, call, spans])
        out += [Report(r, state, text.replace("\x01", str(r)), ranks, call, least, like) for r in range(lo, hi)]
    return out


def table(reports: Iterable[Report]) -> str:
    """One line per rank, aligned; a run of :data:`RUN_LINE` ranks or more with the same report (but
    for the rank's number and its seconds in flight) as one line."""
    if isinstance(reports, Reports):
        segments = reports.segments()
    else:
        segments = [(r.rank, r.rank + 1, _key(r), {f"{r.seconds:.0f}"}, r) for r in sorted(reports, key=lambda r: r.rank)]
    groups: list[list[Any]] = []  # [first rank, stop, key, seconds, parts]
    for lo, hi, key, secs, part in segments:
        if groups and groups[-1][1] == lo and groups[-1][2] == key:
            groups[-1][1] = hi
            groups[-1][3] |= secs
            groups[-1][4].append((lo, hi, part))
        else:
            groups.append([lo, hi, key, set(secs), [(lo, hi, part)]])
    lines = []
    for lo, hi, key, secs, parts in groups:
        if hi - lo < RUN_LINE:
            lines += [f"  {r.state:>10}  {r.text}" for a, b, part in parts for r in _made(a, b, part)]
            continue
        shown = sorted(secs, key=float)
        text = key[1].replace("\x00", shown[0] if len(shown) == 1 else f"{shown[0]}-{shown[-1]}")
        text = text.replace("rank \x01", f"ranks {lo}-{hi - 1}", 1).replace("\x01", "r")
        lines.append(f"  {key[0]:>10}  {text}")
    return "\n".join(lines)
