"""Causes (``rank R raised ...``) kept by every rank, so they outlive the store.

[Note: keeping the causes]
The job's store lives in one process: the rendezvous agent on the first node, or rank 0 itself
under a restartable launch (see [Note: restarts] in hybridshard/launcher/settings.py). When the rank
that fails first takes that process down, its peers' failing collectives cannot read its cause any
more, and could only say that the store is gone. So a cause is published twice: under
``hybridshard/raised/<rank>`` as before, and as the next entry of a numbered list
(``hybridshard/causes`` counts them, ``hybridshard/cause/<n>`` holds one). Every rank's watchdog
reads the counter (one store op) every :func:`poll_every` seconds while the main thread has been
blocked in a collective, or a collective of the runtime in flight, for :data:`WATCH_AFTER` seconds:
exactly when a peer's failure leaves it waiting, never on a step whose collectives return quickly.
It keeps every new cause it finds and acknowledges it under ``hybridshard/cause/<n>/seen``. A
process dying of an uncaught exception waits, after publishing, until every other rank acknowledged
it (or published a cause of its own: it is dying too) or :func:`wait_seconds` passed
(``HYBRIDSHARD_CAUSE_WAIT``, 5 by default), so that its peers, blocked on it, have read it before its
exit takes the store away. The failing collectives, and the check of a stuck one, then name the kept
cause when the store cannot be reached.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import Any

from hybridshard.runtime.faults import peers
from hybridshard.runtime.faults.rank_state import current

logger = logging.getLogger(__name__)

__all__ = ["WATCH_AFTER", "kept", "poll", "poll_every", "poll_if_waiting", "publish", "wait_seconds", "wait_until_seen"]

WATCH_AFTER = 1.0
"""Seconds the main thread must have waited on a collective before the watchdog reads the causes."""
_COUNT = "hybridshard/causes"
_DYING = "hybridshard/causes/ranks"
"""How many distinct ranks have published a cause (each counts once, however many it publishes)."""
_CAUSE = "hybridshard/cause/{}"
_LOCK = threading.Lock()


def state(s: Any) -> dict[str, Any]:
    """This rank's causes for the store ``s``: what it kept (``kept``: rank -> text), the last entry
    it read, the entry it published and that entry's text; fresh for a new store (a new job in the
    same process starts its list at 0)."""
    plane = current()
    with _LOCK:
        if plane.causes.get("store") is not s and s is not None:
            plane.causes = {"store": s, "kept": {}, "read": 0, "published": 0, "last": ""}
        return plane.causes


def wait_seconds() -> float:
    return peers.env_seconds("HYBRIDSHARD_CAUSE_WAIT", 5.0)


def poll_every() -> float:
    """Seconds between two readings of the counter: 2, well inside :func:`wait_seconds` (a dying rank
    waits that long for its peers to read its cause), less when that wait is set below 5 s."""
    return min(2.0, wait_seconds() / 2.5)


def publish(text: str) -> None:
    """Publish this rank's cause ``text`` (``rank R raised ...``) where it is kept (see the note)."""
    s = peers.store()
    if s is None or text == state(s)["last"]:
        return
    me, mine = peers.identity()[0], state(s)
    try:
        n = int(s.add(_COUNT, 1))
        s.set(_CAUSE.format(n), json.dumps({"rank": me, "text": text}).encode())
        if int(s.add(f"{_DYING}/{me}", 1)) == 1:
            s.add(_DYING, 1)
        mine["published"], mine["last"] = n, text
    except Exception:  # noqa: BLE001 - the store may be gone too; the local error still stands
        logger.debug("could not publish the cause", exc_info=True)


def poll() -> None:
    """Keep the causes published since the last call and acknowledge them (the watchdog thread)."""
    s = peers.store()
    if s is None:
        return
    me, mine = peers.identity()[0], state(s)
    try:
        n = int(s.add(_COUNT, 0))
        for k in range(mine["read"] + 1, n + 1):
            if not s.check([_CAUSE.format(k)]):
                break  # counted, not yet written: read at the next poll
            cause = json.loads(s.get(_CAUSE.format(k)).decode())
            if cause["rank"] != me:
                with _LOCK:
                    mine["kept"].setdefault(int(cause["rank"]), cause["text"])
                s.add(f"{_CAUSE.format(k)}/seen", 1)
            mine["read"] = k
    except Exception:  # noqa: BLE001 - the store may be gone: what was kept stays
        logger.debug("could not read the causes", exc_info=True)


def poll_if_waiting(state: Any, pending: list[Any]) -> None:
    """:func:`poll` when the main thread (``state``: :class:`hybridshard.runtime.trace.entry_points.Blocked`)
    or the runtime's oldest collective in flight (``pending``) has waited :data:`WATCH_AFTER` seconds,
    at most once every :func:`poll_every` seconds."""
    waited = time.time() - state.since if state is not None and state.blocked else 0.0
    if pending:
        waited = max(waited, time.monotonic() - pending[0].started)
    plane, now = current(), time.monotonic()
    if waited >= WATCH_AFTER and now - plane.causes_polled >= poll_every():
        plane.causes_polled = now
        poll()


def kept() -> dict[int, str]:
    """The other ranks' causes this rank has read, by rank."""
    with _LOCK:
        return dict(current().causes.get("kept", {}))


def wait_until_seen() -> None:
    """After :func:`publish`, before the process exits: wait until every other rank kept the cause."""
    s = peers.store()
    n, (_, world) = current().causes.get("published", 0), peers.identity()
    if not n or s is None or world == 1:
        return
    deadline = time.monotonic() + wait_seconds()
    try:
        while time.monotonic() < deadline:
            # A rank that published a cause of its own is dying too: it reads nothing more.
            others_dying = int(s.add(_DYING, 0)) - 1
            if int(s.add(f"{_CAUSE.format(n)}/seen", 0)) + others_dying >= world - 1:
                return
            time.sleep(0.05)
    except Exception:  # noqa: BLE001 - the store went first: nothing more to wait for
        logger.debug("could not wait for the cause to be read", exc_info=True)
