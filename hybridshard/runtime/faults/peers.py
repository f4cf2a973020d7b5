"""What each rank tells the others through the job's store: that it is alive and where it is, that it
raised, that it finished.

[Note: heartbeats]
Each rank's watchdog thread (see :mod:`hybridshard.runtime.faults.watchdog`) writes one key of the job's
store (the c10d store every rank already shares) about once a second: ``hybridshard/beat/<rank>``
holds a counter and where the rank is (:func:`beat`), so a rank whose main thread is blocked in a
collective still says where it is. A rank that raised, failed or finished writes that into the same
key and beats no more (:func:`publish`). A rank that needs to describe the job (its collective
failed, or one of its collectives has been stuck too long) reads the keys of every rank in one
``multi_get`` and again, with backoff, until each counter moved (:func:`observe`); a rank is lost
only when its own counter stood still for :data:`REPORT_SECONDS`: killed, crashed, or hung in C++
without its watchdog thread. Nobody answers anybody, and the ranks that ask at the same time share
one such reading ([Note: one reading for the ranks asking at once] in
:mod:`hybridshard.runtime.faults.asks`), so a stall that makes every rank ask at once costs each rank
a handful of store operations and one reading of W keys in all (docs/scale.md has the figures). A
healthy rank's store load is its one write per second.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass, field
from collections.abc import Iterable
from typing import Any, Callable

import torch.distributed as dist

from hybridshard.runtime.faults.rank_state import current

logger = logging.getLogger(__name__)

_WARNED: set[str] = set()
_TALLY = "hybridshard/tally/"


def env_seconds(name: str, default: float) -> float:
    """A number of seconds from the environment variable ``name``, ``default`` when unset. A value that
    is not a number is logged once (expected, found, fix) and ``default`` used: the watchdog thread
    reads these, and an exception there would end the fault checks silently."""
    raw = os.environ.get(name)
    if raw is None:
        return default
    try:
        return float(raw)
    except ValueError:
        if name not in _WARNED:
            _WARNED.add(name)
            logger.warning("expected %s to be a number of seconds, found %r; using %g: set it to a number "
                           "(0 turns the check off where that is documented) or unset it", name, raw, default)
        return default

__all__ = ["FIRST_READ", "env_seconds", "REPORT_SECONDS", "Report", "ask_everyone", "beat", "exchange", "identity", "lost_report",
           "having", "observe", "publish", "published", "ranks_text", "reports", "runs", "store", "table", "tally"]

REPORT_SECONDS = 3.0
"""How long a rank's heartbeat may stand still before it is named lost."""
FIRST_READ = 1.25
"""Seconds from an ask's first reading to its second: a beat a second and a margin, so that one
reading finds every live rank's counter moved (an earlier one finds a fraction and costs a store op)."""
_FINAL = ("raised", "failed", "done")


def _key(rank: int) -> str:
    return f"hybridshard/beat/{rank}"


def store() -> Any:
    """The job's store, or ``None`` (also under torch's ``fake`` backend, one rank standing for a
    job). Kept once found (with this rank's rank and the world size): it stays usable after
    ``destroy_process_group``, while the process hosting it lives."""
    plane = current()
    found = plane.found.get("store")
    if found is None:
        try:
            if dist.get_backend() == "fake":  # torch's fake process group: its store refuses every call
                return None
            found = dist.distributed_c10d._get_default_store()
            plane.found["identity"] = (dist.get_rank(), dist.get_world_size())
        except Exception:  # noqa: BLE001 - no process group yet, or gone: callers go without
            return None
        plane.found["store"] = found
    return found


def identity() -> tuple[int, int]:
    """``(rank, world size)``, also after ``destroy_process_group`` once :func:`store` was found."""
    plane = current()
    if not plane.explicit and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return plane.found.get("identity", (0, 1))


@dataclass(slots=True)
class Report:
    """What one rank said about itself. [Note: reports by the thousand] A fault check hands every rank
    a report per rank (W of them, on every survivor at once): a plain slotted class is made in a fifth
    of a frozen dataclass's time, and :attr:`like` keeps the key a table sorts it by, computed once."""

    rank: int
    state: str
    """``"raised"`` (a cause), ``"failed"`` (a collective failed: a consequence), ``"done"``,
    ``"collective"`` (blocked in one), ``"running"`` or ``"lost"``."""
    text: str
    """One line, starting with ``rank <r>``."""
    ranks: tuple[int, ...] | range = field(default=())
    """The group of the collective it is blocked in (state ``"collective"``; a ``range`` when contiguous)."""
    call: str = ""
    """The API call it is in (empty: training)."""
    seconds: float = 0.0
    """How long the collective it is in has been in flight (state ``"collective"``)."""
    like: tuple[Any, ...] = field(default=(), compare=False, repr=False)
    """What it shares with the reports printed on one line with it (state, text but for its rank and
    seconds, call, group); empty until :func:`hybridshard.runtime.faults.asks.table` needs it."""


def ranks_text(ranks: Any) -> str:
    """``[0, 1, 2, 3]``; a long contiguous group as ``[0, 1, ..., 4095]`` (a line, not 20 KB)."""
    ranks = list(ranks)
    if len(ranks) > 8 and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"[{ranks[0]}, {ranks[1]}, ..., {ranks[-1]}]"
    if len(ranks) > 16:
        return f"[{', '.join(map(str, ranks[:16]))}, ... ({len(ranks)} ranks)]"
    return str(ranks)


def runs(ranks: list[int]) -> list[list[int]]:
    """``[0, 1, 2, 5]`` as ``[[0, 3], [5, 6]]``: a group of the whole job stays a few bytes."""
    out: list[list[int]] = []
    for r in ranks:
        if out and out[-1][1] == r:
            out[-1][1] = r + 1
        else:
            out.append([r, r + 1])
    return out


def _encode(n: int, status: dict[str, Any]) -> bytes:
    body = {k: v for k, v in status.items() if k != "ranks"}
    if status.get("ranks") and "runs" not in body:
        body["runs"] = runs(list(status["ranks"]))
    return f"{n}|{json.dumps(body)}".encode()


def _count(value: bytes) -> int:
    return int(value.split(b"|", 1)[0])


def _report(rank: int, value: bytes) -> Report:
    a = json.loads(value.split(b"|", 1)[1])
    spans = a.get("runs", ())
    ranks = range(*spans[0]) if len(spans) == 1 else tuple(r for lo, hi in spans for r in range(lo, hi))
    return Report(rank, a["state"], a["text"], ranks, a.get("call", ""), float(a.get("seconds", 0.0)))


def beat(status: dict[str, Any] | Callable[[], dict[str, Any]], *, every: float = 0.0) -> None:
    """Write this rank's heartbeat (see [Note: heartbeats]) with ``status`` (the fields of
    :class:`Report` but ``rank``; a callable is called only when a beat is due), unless one was
    written less than ``every`` seconds ago or this rank published its end."""
    plane = current()
    now = time.monotonic()
    if plane.final is not None or now - plane.last_beat < every:
        return
    s = store()
    if s is None:
        return
    mine = plane.override or (status() if callable(status) else status)
    plane.beats += 1
    plane.last_beat = now
    try:
        s.set(_key(identity()[0]), _encode(plane.beats, mine))
    except Exception:  # noqa: BLE001 - the store may be gone; the next beat tries again
        logger.debug("could not write the heartbeat", exc_info=True)


def publish(kind: str, text: str) -> None:
    """Say that this rank ``kind`` (``"raised"``, ``"failed"`` or ``"done"``): its heartbeat holds
    ``text`` from now on, and never moves again."""
    plane = current()
    s = store()
    if s is None:
        return
    counted = plane.final is not None and plane.final["state"] == kind
    plane.final = {"state": kind, "text": text}
    plane.beats += 1
    try:
        s.set(_key(identity()[0]), _encode(plane.beats, plane.final))
        if not counted:  # after the heartbeat: a rank counted has said what it did; once a kind
            s.add(_TALLY + kind, 1)
    except Exception:  # noqa: BLE001 - the store may be gone too; the local error still stands
        logger.debug("could not publish %s to the store", kind, exc_info=True)


def tally(name: str, add: int = 0) -> int | None:
    """The job-wide count ``name`` after adding ``add``, in one store operation: how many ranks
    published each kind (``"done"``, ``"raised"``, ``"failed"``) and other counts a rank keeps with
    :func:`tally` itself. ``None`` when the store cannot be reached."""
    s = store()
    if s is None:
        return None
    try:
        return int(s.add(_TALLY + name, add))
    except Exception:  # noqa: BLE001
        logger.debug("could not read the count %s", name, exc_info=True)
        return None


def _present(s: Any, ranks: list[int], keys: list[str] | None = None) -> list[int]:
    """The ranks of ``ranks`` whose key (their heartbeat's, or ``keys[rank]``) exists: one ``check``
    when all do, halving otherwise (``multi_get`` of a missing key would wait for it)."""
    if not ranks or s.check([keys[r] if keys else _key(r) for r in ranks]):
        return ranks
    if len(ranks) == 1:
        return []
    half = len(ranks) // 2
    return _present(s, ranks[:half], keys) + _present(s, ranks[half:], keys)


def _read(s: Any, ranks: list[int], seen: Any = ()) -> dict[int, bytes]:
    """The heartbeats of ``ranks``: one ``multi_get`` when all of them were ``seen`` already (keys stay)."""
    if not all(r in seen for r in ranks):
        ranks = _present(s, ranks)
    return dict(zip(ranks, s.multi_get([_key(r) for r in ranks]))) if ranks else {}


def _is_final(value: bytes) -> bool:
    return any(f'"state": "{k}"'.encode() in value for k in _FINAL)


def exchange(name: str, value: bytes, world: int, seconds: float) -> dict[int, bytes] | None:
    """Leave ``value`` under ``hybridshard/<name>/<rank>`` and read every rank's, waiting up to
    ``seconds`` for all of them (with backoff): a failure path's detail, O(W) bytes, never a healthy
    step's. ``None`` without a store."""
    s = store()
    if s is None:
        return None
    keys = [f"hybridshard/{name}/{r}" for r in range(world)]
    try:
        s.set(keys[identity()[0]], value)
        deadline, pause = time.monotonic() + seconds, 0.05
        while not s.check(keys) and time.monotonic() < deadline:
            time.sleep(pause)
            pause = min(2 * pause, 1.0)
        ranks = _present(s, list(range(world)), keys)
        return dict(zip(ranks, s.multi_get([keys[r] for r in ranks]))) if ranks else {}
    except Exception:  # noqa: BLE001 - the store may be gone: the caller goes with what it knows
        logger.debug("could not exchange %s", name, exc_info=True)
        return None


def published(kind: str, ranks: list[int]) -> dict[int, str] | None:
    """What ``ranks`` published under ``kind``; ``None`` when the store cannot be reached."""
    s = store()
    if s is None:
        return None
    try:
        beats = _read(s, list(ranks))
    except Exception:  # noqa: BLE001
        logger.debug("could not read %s from the store", kind, exc_info=True)
        return None
    reports = (_report(r, v) for r, v in beats.items() if _is_final(v))
    return {r.rank: r.text for r in reports if r.state == kind}


def ask_everyone(mine: dict[str, Any], seconds: float = REPORT_SECONDS,
                 while_waiting: Callable[[], None] | None = None, *, brief: bool = False) -> list[Report] | None:
    """Where every rank is; one :class:`Report` per rank, ``None`` when the store is unreachable.

    ``mine`` is this rank's own answer, in its heartbeat meanwhile. A rank whose heartbeat did not
    move in ``seconds`` (and that did not say it raised, failed or finished) is lost. ``while_waiting``
    runs between polls: the watchdog thread, which beats, keeps beating while it asks itself (ranks
    stuck in the same collective ask at the same time). ``brief``: only the ranks that are lost or
    said they raised, failed or finished (no other heartbeat is decoded). Ranks asking at the same
    time share one reading: see [Note: one reading for the ranks asking at once] in
    :mod:`hybridshard.runtime.faults.asks`, and [Note: heartbeats].
    """
    from hybridshard.runtime.faults import asks  # it builds on this module

    plane = current()
    s = store()
    if s is None:
        return None
    me, world = identity()
    plane.override = mine
    try:
        if plane.final is None:
            plane.beats += 1
            s.set(_key(me), _encode(plane.beats, mine))
        return asks.shared(s, me, world, mine, seconds, while_waiting, brief)
    except Exception:  # noqa: BLE001 - a lost store leaves the names out, not the error
        logger.debug("could not read the other ranks' heartbeats", exc_info=True)
        return None
    finally:
        plane.override = None


def observe(s: Any, me: int, world: int, seconds: float, while_waiting: Callable[[], None] | None = None,
            on_reread: Callable[[], None] | None = None) -> tuple[dict[int, bytes], set[int]]:
    """Every rank's heartbeat, read at once and again (with backoff) until each counter moved or
    ``seconds`` passed: ``(the heartbeats last read, the ranks lost)``. A rank is lost when its own
    counter stood still that long and it did not say it raised, failed or finished; never ``me``.
    ``on_reread`` runs once, just before the second reading."""
    seen = _read(s, list(range(world)))
    first = {r: _count(v) for r, v in seen.items()}
    waiting = [r for r in range(world) if r != me and not (r in seen and _is_final(seen[r]))]
    start, poll = time.monotonic(), FIRST_READ
    next_read = start + poll
    while waiting and time.monotonic() < start + seconds:
        if while_waiting is not None:
            while_waiting()
        # [Note: few wake-ups] a sleeper per rank at 20 Hz is 20 W wake-ups a second on a shared host;
        # sleeping to the next read (at most 0.25 s, the beats' pace) keeps them few.
        time.sleep(max(0.01, min(0.25, min(next_read, start + seconds) - time.monotonic())))
        if time.monotonic() >= min(next_read, start + seconds):  # backoff: 1.25, 3.75, 8.75 s ..., the deadline
            if on_reread is not None:
                on_reread()
                on_reread = None
            now = _read(s, waiting, seen)
            seen.update(now)
            waiting = [r for r in waiting if r not in now or (r in first and _count(now[r]) == first[r])]
            poll = min(2 * poll, 5.0)
            next_read = time.monotonic() + poll
    return seen, set(waiting)


def lost_report(rank: int, seconds: float) -> Report:
    return Report(rank, "lost", f"rank {rank}: no answer within {seconds:.0f}s (killed, crashed or hung)")


def reports(me: int, world: int, mine: dict[str, Any], seen: dict[int, bytes], lost: set[int], seconds: float,
            brief: bool, *, with_me: bool = False) -> list[Report]:
    """One :class:`Report` per rank from the heartbeats ``seen`` (``brief``: the lost and the ranks that
    said they raised, failed or finished; ``with_me``: this rank too, ``mine`` unless it published its end)."""
    final = current().final
    out = []
    for r in range(world):
        if brief and r not in lost:
            if r == me and not (with_me and final is not None):
                continue
            if r != me and not _is_final(seen.get(r, b"")):
                continue
        if r in lost:
            out.append(lost_report(r, seconds))
        elif r == me and final is None:
            m = mine
            out.append(Report(r, m["state"], m["text"], tuple(m.get("ranks", ())), m.get("call", ""),
                              float(m.get("seconds", 0.0))))
        else:
            out.append(_report(r, seen[r]))
    return out


def having(reports: Iterable[Report], states: Iterable[str]) -> list[Report]:
    """The reports in one of ``states``, in rank order (see :func:`hybridshard.runtime.faults.asks.having`)."""
    from hybridshard.runtime.faults import asks  # it builds on this module

    return asks.having(reports, states)


def table(reports: Iterable[Report]) -> str:
    """One line per rank, aligned, long runs of ranks alike as one line: what the hang report and fault
    messages print (see :func:`hybridshard.runtime.faults.asks.table`)."""
    from hybridshard.runtime.faults import asks  # it builds on this module

    return asks.table(reports)
