"""Collectives in flight, and a thread that answers the other ranks and reports a hang.

[Note: hang report]
Every collective the runtime issues is registered here while in flight (kind, group, elements,
where the rank was, since when), until it completes: a blocking one until it returns, an
asynchronous one until its handle says it completed (on NCCL that is when the device finished it,
not when ``wait()`` returned). One daemon thread per process, started with the first sharded
model, wakes about once a second and

- answers any rank that asked where everyone is (see [Note: asking every rank where it is] in
  :mod:`hybridshard.runtime.peers`), from the registry and :mod:`hybridshard.runtime.position`,
  even while the main thread is blocked in a collective;
- when a collective of this rank has been in flight longer than :func:`hang_seconds` (the
  ``HYBRIDSHARD_HANG_SECONDS`` environment variable, 300 by default: well below the process
  group's timeout, 30 minutes by default), asks every rank and logs one table naming where each
  rank is, once per stuck collective. A collective issued on some ranks only (``full_state_dict``
  under ``if rank == 0``, say) is then named within that time on gloo and NCCL alike, instead of
  failing silently at the timeout;
- when a collective of this rank has been in flight longer than :func:`fault_seconds` and a rank of
  its group raised, left or is lost, logs why and stops the process (see [Note: a stuck collective
  with a lost peer] in :mod:`hybridshard.runtime.faults`).
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch.distributed as dist

from hybridshard.runtime import causes, faults, peers
from hybridshard.runtime.mismatch import MismatchWatch, mismatch_seconds
from hybridshard.runtime.position import Where, current_where, snapshot
from hybridshard.topology.groups import group_ranks

logger = logging.getLogger(__name__)

__all__ = ["InFlight", "begin", "end", "hang_seconds", "my_status", "start"]

_DEFAULT_HANG_SECONDS = 300.0
_DEFAULT_FAULT_SECONDS = 60.0


def _seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


def hang_seconds() -> float:
    """Seconds a collective may stay in flight before the hang report (``HYBRIDSHARD_HANG_SECONDS``)."""
    return _seconds("HYBRIDSHARD_HANG_SECONDS", _DEFAULT_HANG_SECONDS)


def fault_seconds() -> float:
    """Seconds a collective may stay in flight before its group's ranks are checked for a lost one
    (``HYBRIDSHARD_FAULT_SECONDS``; 0 or less: never)."""
    return _seconds("HYBRIDSHARD_FAULT_SECONDS", _DEFAULT_FAULT_SECONDS)


@dataclass
class InFlight:
    """One collective between its issue and its completion."""

    kind: str
    group: str
    pg: Any
    """The process group, for its ranks (looked up only when described)."""
    numel: int
    where: Where
    started: float
    work: Any = None
    """The backend's handle of an asynchronous collective, polled for completion."""
    reported: bool = False
    checked: bool = False
    """Its group's ranks were checked for a lost one (see :func:`fault_seconds`)."""

    def ranks(self) -> list[int]:
        """The group's global ranks; none once the group was destroyed (at exit) while this was registered."""
        try:
            return group_ranks(self.pg)
        except (KeyError, RuntimeError, ValueError):
            return []

    def describe(self, now: float) -> str:
        return (f"{self.kind} of {self.numel} elements on the {self.group} group (ranks {self.ranks()}) for "
                f"{now - self.started:.0f}s, {self.where.describe()}")


_LOCK = threading.Lock()
_IN_FLIGHT: dict[int, InFlight] = {}
_IDS = itertools.count()
_THREAD: dict[str, threading.Thread] = {}
_STOP = threading.Event()


def begin(kind: str, group: str, pg: Any, numel: int) -> int:
    """Register a collective about to be issued; the token for :func:`end`."""
    token = next(_IDS)
    entry = InFlight(kind, group, pg, numel, snapshot(), time.monotonic())
    with _LOCK:
        _IN_FLIGHT[token] = entry
    return token


def attach_work(token: int, work: Any) -> None:
    with _LOCK:
        entry = _IN_FLIGHT.get(token)
        if entry is not None:
            entry.work = work


def end(token: int | None) -> None:
    if token is None:
        return
    with _LOCK:
        _IN_FLIGHT.pop(token, None)


def _prune() -> list[InFlight]:
    """Drop the asynchronous collectives that completed; the ones still in flight, oldest first."""
    with _LOCK:
        for token, entry in list(_IN_FLIGHT.items()):
            if entry.work is not None:
                try:
                    if entry.work.is_completed():
                        del _IN_FLIGHT[token]
                except Exception:  # noqa: BLE001 - a failed handle: its waiter reports it
                    del _IN_FLIGHT[token]
        return sorted(_IN_FLIGHT.values(), key=lambda e: e.started)


def my_status() -> dict[str, Any]:
    """This rank's answer to the others (see :func:`hybridshard.runtime.peers.answer`)."""
    rank = peers.identity()[0]
    pending = _prune()
    now = time.monotonic()
    if pending:
        first = pending[0]
        return {"state": "collective", "text": f"rank {rank}: in {first.describe(now)}",
                "ranks": first.ranks(), "call": first.where.call, "seconds": now - first.started}
    here = current_where()
    return {"state": "running", "text": f"rank {rank}: not in a collective of the runtime ({here.describe()})",
            "call": here.call}


def _poll_seconds() -> float:
    """About once a second; faster when a limit is only seconds (tests)."""
    limits = [x for x in (hang_seconds(), fault_seconds(), mismatch_seconds()) if x > 0]
    return min(1.0, max(0.05, min(limits, default=4.0) / 4))


_ANSWERED = {"n": 0}


def _answer_asks() -> None:
    """Answer every ask of the other ranks since the last call (the watchdog thread only)."""
    n = peers.asked()
    if n > _ANSWERED["n"]:
        status = my_status()
        for k in range(_ANSWERED["n"] + 1, n + 1):
            if not peers.is_own_ask(k):
                peers.answer(k, status)
        _ANSWERED["n"] = n


def _loop() -> None:
    main = MismatchWatch()  # see [Note: entry point on some ranks only] in hybridshard.runtime.mismatch
    while not _STOP.wait(_poll_seconds()):
        if not dist.is_initialized():
            continue
        try:
            pending = _prune()
            causes.poll_if_waiting(main.poll(pending), pending)  # see [Note: keeping the causes]
            _answer_asks()
            _report_if_stuck()
            _stop_if_peers_gone()
        except Exception:  # noqa: BLE001 - the watchdog must never take the job down
            logger.debug("watchdog iteration failed", exc_info=True)


def _report_if_stuck() -> None:
    limit, now = hang_seconds(), time.monotonic()
    stuck = [e for e in _prune() if not e.reported and now - e.started > limit]
    if not stuck:
        return
    for entry in stuck:
        entry.reported = True
    reports = peers.ask_everyone(my_status(), while_waiting=_answer_asks)
    rank = dist.get_rank()
    head = (f"rank {rank} has been in {stuck[0].describe(now)} for longer than {limit:.0f}s "
            "(HYBRIDSHARD_HANG_SECONDS); where every rank is:")
    if reports is None:
        logger.error("%s unknown: the job's store cannot be reached", head)
        return
    logger.error("%s\n%s\nA collective issued on some ranks only (say under `if rank == 0`) or a rank "
                 "that left the training loop early leaves the others waiting like this.", head, peers.table(reports))


def _stop_if_peers_gone() -> None:
    """See [Note: a stuck collective with a lost peer] in :mod:`hybridshard.runtime.faults`."""
    limit, now = fault_seconds(), time.monotonic()
    if limit <= 0:
        return
    stuck = [e for e in _prune() if not e.checked and now - e.started > limit]
    if not stuck:
        return
    for entry in stuck:
        entry.checked = True
    entry = stuck[0]
    message = faults.peers_gone(entry.kind, entry.group, entry.ranks(), entry.where.describe(),
                                now - entry.started, my_status(), while_waiting=_answer_asks)
    if message is None:
        return
    logger.critical("%s", message)
    faults.write_error_file(faults.CollectiveError(message), consequence=True)
    peers.publish("failed", f"rank {peers.identity()[0]} stopped: {faults.first_line(message)}")
    faults.stop_now(1)


def start() -> None:
    """Start the watchdog thread of this process (once)."""
    with _LOCK:
        if "thread" in _THREAD and _THREAD["thread"].is_alive():
            return
        _STOP.clear()
        _ANSWERED["n"] = 0
        thread = threading.Thread(target=_loop, name="hybridshard-watchdog", daemon=True)
        _THREAD["thread"] = thread
    thread.start()
    atexit.register(stop)


def stop() -> None:
    """Stop the thread and wait for it: no store call of ours may run while the process exits."""
    _STOP.set()
    thread = _THREAD.pop("thread", None)
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5.0)
