"""Collectives in flight, and a thread that answers the other ranks and reports a hang.

[Note: hang report]
Every collective the runtime issues is registered here while in flight (kind, group, elements,
where the rank was, since when): a blocking one until it returns, an asynchronous one until its
handle says it completed (on NCCL: when the device finished it). One daemon thread per process,
started with the first sharded model, wakes about once a second and

- writes this rank's heartbeat ([Note: heartbeats] in :mod:`hybridshard.runtime.faults.peers`),
  even while the main thread is blocked in a collective;
- once a collective has been in flight longer than :func:`hang_seconds` (``HYBRIDSHARD_HANG_SECONDS``,
  300 by default, well below the process group's timeout), asks every rank and logs one table of
  where each is, once per stuck collective: a collective issued on some ranks only is named then;
- once it has been in flight longer than :func:`fault_seconds` and a rank of its group raised, left
  or is lost, logs why and stops the process ([Note: a stuck collective with a lost peer]).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from hybridshard.runtime.faults import causes, errors, partition, peers
from hybridshard.runtime.faults.mismatch import MismatchWatch, mismatch_seconds
from hybridshard.runtime.faults.rank_state import ControlPlane, bound, current
from hybridshard.runtime.trace.position import Where, current_where, snapshot
from hybridshard.topology.groups import group_ranks

logger = logging.getLogger(__name__)

__all__ = ["InFlight", "begin", "end", "hang_seconds", "my_status", "start"]

_DEFAULT_HANG_SECONDS = 300.0
_DEFAULT_FAULT_SECONDS = 60.0


def hang_seconds() -> float:
    """Seconds a collective may stay in flight before the hang report (``HYBRIDSHARD_HANG_SECONDS``)."""
    return peers.env_seconds("HYBRIDSHARD_HANG_SECONDS", _DEFAULT_HANG_SECONDS)


def fault_seconds() -> float:
    """Seconds a collective may stay in flight before its group's ranks are checked for a lost one
    (``HYBRIDSHARD_FAULT_SECONDS``; 0 or less: never)."""
    return peers.env_seconds("HYBRIDSHARD_FAULT_SECONDS", _DEFAULT_FAULT_SECONDS)


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
    _ranks: list[int] | None = None
    _runs: list[list[int]] | None = None

    def ranks(self) -> list[int]:
        """The group's global ranks; none once the group was destroyed (at exit) while this was registered."""
        if self._ranks is None:
            if isinstance(self.pg, (list, tuple, range)):  # the scale harness's simulated groups
                self._ranks = list(self.pg)
            else:
                try:
                    self._ranks = group_ranks(self.pg)
                except (KeyError, RuntimeError, ValueError):
                    return []
        return self._ranks

    def runs(self) -> list[list[int]]:
        """:meth:`ranks` as ``[start, stop)`` runs, kept: what every heartbeat carries."""
        if self._runs is None:
            self._runs = peers.runs(self.ranks())
        return self._runs

    def describe(self, now: float) -> str:
        return (f"{self.kind} of {self.numel} elements on the {self.group} group (ranks {peers.ranks_text(self.ranks())}) for "
                f"{now - self.started:.0f}s, {self.where.describe()}")


def begin(kind: str, group: str, pg: Any, numel: int) -> int:
    """Register a collective about to be issued; the token for :func:`end`."""
    plane = current()
    token = next(plane.ids)
    entry = InFlight(kind, group, pg, numel, snapshot(), time.monotonic())
    with plane.lock:
        plane.in_flight[token] = entry
    return token


def attach_work(token: int, work: Any) -> None:
    plane = current()
    with plane.lock:
        entry = plane.in_flight.get(token)
        if entry is not None:
            entry.work = work


class _Settled:
    """A waited collective the device still runs, as the registry keeps it: an event the waiting stream
    recorded after it, not the work, which holds the collective's tensors (an unsharded gradient kept
    until the next poll, up to a second, for every unit reduced meanwhile)."""

    __slots__ = ("event",)

    def __init__(self, event: Any) -> None:
        self.event = event

    def is_completed(self) -> bool:
        return self.event.query()


def settle(token: int | None) -> None:
    """The collective ``token`` was waited (NCCL: the current stream waits for it) but has not completed:
    keep an event after it instead of its work. Elsewhere its work stays (a wait there completes it)."""
    if token is None or not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    event = torch.cuda.Event()
    event.record()
    plane = current()
    with plane.lock:
        entry = plane.in_flight.get(token)
        if entry is not None:
            entry.work = _Settled(event)


def end(token: int | None) -> None:
    if token is None:
        return
    plane = current()
    with plane.lock:
        plane.in_flight.pop(token, None)


def _prune() -> list[InFlight]:
    """Drop the asynchronous collectives that completed; the ones still in flight, oldest first."""
    plane = current()
    with plane.lock:
        for token, entry in list(plane.in_flight.items()):
            if entry.work is not None:
                try:
                    if entry.work.is_completed():
                        del plane.in_flight[token]
                except Exception:  # noqa: BLE001 - a failed handle: its waiter reports it
                    del plane.in_flight[token]
        return sorted(plane.in_flight.values(), key=lambda e: e.started)


def my_status() -> dict[str, Any]:
    """This rank's heartbeat status (see :func:`hybridshard.runtime.faults.peers.beat`)."""
    rank = peers.identity()[0]
    pending = _prune()
    now = time.monotonic()
    if pending:
        first = pending[0]
        return {"state": "collective", "text": f"rank {rank}: in {first.describe(now)}",
                "ranks": first.ranks(), "runs": first.runs(), "call": first.where.call, "seconds": now - first.started}
    here = current_where()
    return {"state": "running", "text": f"rank {rank}: not in a collective of the runtime ({here.describe()})",
            "call": here.call}


def _poll_seconds() -> float:
    """About once a second; faster when a limit is only seconds (tests)."""
    limits = [x for x in (hang_seconds(), fault_seconds(), mismatch_seconds()) if x > 0]
    return min(1.0, max(0.05, min(limits, default=4.0) / 4))


def _beat() -> None:
    """This rank's heartbeat, when one is due (also while the watchdog thread itself asks)."""
    peers.beat(my_status, every=0.9 * _poll_seconds())


def _ready(plane: ControlPlane) -> bool:
    return plane.is_ready() if plane.is_ready is not None else dist.is_initialized()


def _loop(plane: ControlPlane) -> None:
    with bound(plane):
        main = MismatchWatch(_beat)  # see [Note: entry point on some ranks only] in hybridshard.runtime.faults.mismatch
        if _ready(plane):
            _beat()  # at once: a rank that never beat is lost to its peers
        while not plane.stop.wait(_poll_seconds()):
            if _ready(plane):
                _iteration(main)


def _iteration(main: MismatchWatch) -> None:
    try:
        _beat()
        partition.learn(_waited, _stop_partitioned)  # see [Note: a partition, not lost ranks]
        pending = _prune()
        causes.poll_if_waiting(main.poll(pending), pending)  # see [Note: keeping the causes]
        _report_if_stuck()
        _stop_if_peers_gone()
    except Exception:  # noqa: BLE001 - the watchdog must never take the job down
        logger.debug("watchdog iteration failed", exc_info=True)


def _waited() -> float:
    """Seconds the oldest collective in flight has been in flight; 0 when none is."""
    pending = _prune()
    return time.monotonic() - pending[0].started if pending else 0.0


def _stop_partitioned(message: str) -> None:
    """This rank's rack lost the store's rack (the store probe's verdict): say so and stop."""
    message = f"{message}\n{errors.RESTART}"
    logger.critical("%s", message)
    errors.write_error_file(errors.CollectiveError(message), consequence=True)
    errors.stop_now(1)


def _report_if_stuck() -> None:
    limit, now = hang_seconds(), time.monotonic()
    stuck = [e for e in _prune() if not e.reported and now - e.started > limit]
    if not stuck:
        return
    for entry in stuck:
        entry.reported = True
    reports = peers.ask_everyone(my_status(), while_waiting=_beat)
    rank = peers.identity()[0]
    head = (f"rank {rank} has been in {stuck[0].describe(now)} for longer than {limit:.0f}s "
            "(HYBRIDSHARD_HANG_SECONDS); where every rank is:")
    if reports is None:
        logger.error("%s unknown: the job's store cannot be reached", head)
        return
    logger.error("%s\n%s\nA collective issued on some ranks only (say under `if rank == 0`) or a rank "
                 "that left the training loop early leaves the others waiting like this.", head, peers.table(reports))


def _stop_if_peers_gone() -> None:
    """See [Note: a stuck collective with a lost peer] in :mod:`hybridshard.runtime.faults.errors`."""
    limit, now = fault_seconds(), time.monotonic()
    if limit <= 0:
        return
    stuck = [e for e in _prune() if not e.checked and now - e.started > limit]
    if not stuck:
        return
    for entry in stuck:
        entry.checked = True
    entry = stuck[0]
    message = errors.peers_gone(entry.kind, entry.group, entry.ranks(), entry.where.describe(),
                                now - entry.started, my_status(), while_waiting=_beat)
    if message is None:
        return
    logger.critical("%s", message)
    errors.write_error_file(errors.CollectiveError(message), consequence=True)
    peers.publish("failed", f"rank {peers.identity()[0]} stopped: {errors.first_line(message)}")
    errors.stop_now(1)


def start() -> None:
    """Start the watchdog thread of this rank (once; see [Note: one control plane per rank] in
    :mod:`hybridshard.runtime.faults.rank_state`)."""
    plane = current()
    with plane.lock:
        if plane.thread is not None and plane.thread.is_alive():
            return
        plane.stop.clear()
        thread = threading.Thread(target=_loop, args=(plane,), name="hybridshard-watchdog", daemon=True)
        plane.thread = thread
    thread.start()
    if not plane.explicit:
        atexit.register(stop)


def stop() -> None:
    """Stop the thread and wait for it: no store call of ours may run while the process exits."""
    plane = current()
    plane.stop.set()
    thread, plane.thread = plane.thread, None
    if thread is not None and thread is not threading.current_thread():
        thread.join(timeout=5.0)
