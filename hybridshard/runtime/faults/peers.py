"""What each rank tells the others through the job's store: that it raised, that it finished, and
where it is right now when a peer asks.

[Note: asking every rank where it is]
A rank that needs to describe the job (its collective failed, or one of its collectives has been
stuck too long) bumps the counter ``hybridshard/ask`` in the job's store (the c10d store every rank
already shares) and waits up to :data:`REPORT_SECONDS` for an answer from every rank under
``hybridshard/status/<n>/<rank>``. Every rank answers from its watchdog thread (see
:mod:`hybridshard.runtime.faults.watchdog`), which polls the counter about once a second, so a rank whose
main thread is blocked in a collective still says where it is. A rank that raised publishes its
error under ``hybridshard/raised/<rank>`` before it leaves, and a rank whose training finished
publishes its step count under ``hybridshard/done/<rank>`` (:func:`publish`). A rank with none of
these is lost: killed, crashed, or hung in C++ without its watchdog thread. Nothing here runs on a
healthy step except the watchdog's one small store read per second.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["REPORT_SECONDS", "Report", "ask_everyone", "answer", "asked", "publish", "published", "store", "table"]

REPORT_SECONDS = 3.0
"""How long a rank waits for every rank's answer before naming the silent ones lost."""
_ASK = "hybridshard/ask"
_STORE: dict[str, Any] = {}
_OWN_ASKS: set[int] = set()


def is_own_ask(n: int) -> bool:
    """Whether this rank asked ask ``n`` (and answered it itself)."""
    return n in _OWN_ASKS


def store() -> Any:
    """The job's store, or ``None`` (also under torch's ``fake`` backend, one rank standing for a
    job). Kept once found (with this rank's rank and the world size): it stays usable after
    ``destroy_process_group``, while the process hosting it lives."""
    found = _STORE.get("store")
    if found is None:
        try:
            if dist.get_backend() == "fake":  # torch's fake process group: its store refuses every call
                return None
            found = dist.distributed_c10d._get_default_store()
            _STORE["identity"] = (dist.get_rank(), dist.get_world_size())
        except Exception:  # noqa: BLE001 - no process group yet, or gone: callers go without
            return None
        _STORE["store"] = found
    return found


def identity() -> tuple[int, int]:
    """``(rank, world size)``, also after ``destroy_process_group`` once :func:`store` was found."""
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return _STORE.get("identity", (0, 1))


def forget_store() -> None:
    _STORE.clear()


@dataclass(frozen=True)
class Report:
    """What one rank said about itself."""

    rank: int
    state: str
    """``"raised"`` (a cause), ``"failed"`` (a collective failed: a consequence), ``"done"``,
    ``"collective"`` (blocked in one), ``"running"`` or ``"lost"``."""
    text: str
    """One line, starting with ``rank <r>``."""
    ranks: tuple[int, ...] = field(default=())
    """The group of the collective it is blocked in (state ``"collective"``)."""
    call: str = ""
    """The API call it is in (empty: training)."""
    seconds: float = 0.0
    """How long the collective it is in has been in flight (state ``"collective"``)."""


def publish(kind: str, text: str) -> None:
    """Leave ``text`` under ``hybridshard/<kind>/<rank>`` (``kind``: ``"raised"`` or ``"done"``)."""
    s = store()
    if s is None:
        return
    try:
        s.set(f"hybridshard/{kind}/{identity()[0]}", text.encode())
    except Exception:  # noqa: BLE001 - the store may be gone too; the local error still stands
        logger.debug("could not publish %s to the store", kind, exc_info=True)


def published(kind: str, ranks: list[int]) -> dict[int, str] | None:
    """What ``ranks`` published under ``kind``; ``None`` when the store cannot be reached."""
    s = store()
    if s is None:
        return None
    try:
        keys = {r: f"hybridshard/{kind}/{r}" for r in ranks}
        return {r: s.get(k).decode() for r, k in keys.items() if s.check([k])}
    except Exception:  # noqa: BLE001
        logger.debug("could not read %s from the store", kind, exc_info=True)
        return None


def asked() -> int:
    """The ask counter (0 when never asked, or unreachable)."""
    s = store()
    if s is None:
        return 0
    try:
        return int(s.add(_ASK, 0))
    except Exception:  # noqa: BLE001
        return 0


def answer(n: int, status: dict[str, Any]) -> None:
    """Answer ask ``n`` with ``status`` (the fields of :class:`Report` but ``rank``; see [Note: asking
    every rank where it is])."""
    s = store()
    if s is None:
        return
    try:
        s.set(f"hybridshard/status/{n}/{identity()[0]}", json.dumps(status).encode())
    except Exception:  # noqa: BLE001
        logger.debug("could not answer ask %d", n, exc_info=True)


def ask_everyone(mine: dict[str, Any], seconds: float = REPORT_SECONDS,
                 while_waiting: Callable[[], None] | None = None) -> list[Report] | None:
    """Ask every rank where it is; one :class:`Report` per rank, ``None`` when the store is unreachable.

    ``mine`` is this rank's own answer (see :func:`answer`). Ranks that published that they raised or finished
    are reported so even if they answer nothing; the others that do not answer in ``seconds`` are lost.
    ``while_waiting`` runs between polls: the watchdog thread, which answers the others' asks, keeps
    answering them while it asks itself (ranks stuck in the same collective ask at the same time).
    """
    s = store()
    if s is None:
        return None
    me, world = identity()
    try:
        n = int(s.add(_ASK, 1))
        _OWN_ASKS.add(n)
        answer(n, mine)
        keys = {r: f"hybridshard/status/{n}/{r}" for r in range(world)}
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline and not s.check(list(keys.values())):
            if while_waiting is not None:
                while_waiting()
            time.sleep(0.1)
        answers = {r: json.loads(s.get(k).decode()) for r, k in keys.items() if s.check([k])}
        raised = published("raised", list(range(world))) or {}
        failed = published("failed", list(range(world))) or {}
        done = published("done", list(range(world))) or {}
    except Exception:  # noqa: BLE001 - a lost store leaves the names out, not the error
        logger.debug("could not ask the other ranks", exc_info=True)
        return None
    out = []
    for r in range(world):
        if r in raised and r != me:
            out.append(Report(r, "raised", raised[r]))
        elif r in failed and r != me:
            out.append(Report(r, "failed", failed[r]))
        elif r in done and r != me:
            out.append(Report(r, "done", done[r]))
        elif r in answers:
            a = answers[r]
            out.append(Report(r, a["state"], a["text"], tuple(a.get("ranks", ())), a.get("call", ""),
                              float(a.get("seconds", 0.0))))
        else:
            out.append(Report(r, "lost", f"rank {r}: no answer within {seconds:.0f}s (killed, crashed or hung)"))
    return out


def table(reports: list[Report]) -> str:
    """One line per rank, aligned: what the hang report and fault messages print."""
    return "\n".join(f"  {r.state:>10}  {r.text}" for r in reports)
