"""Faults between ranks: every error says first which rank did what, then the details.

[Note: naming the lost rank]
When a rank dies, its peers' pending collective fails (at once on gloo, after the process group's
timeout on NCCL), and the backend's message names an address at best. So a rank whose collective
failed reads where every rank is from the job's store ([Note: heartbeats] in
:mod:`hybridshard.runtime.faults.peers`) and leads its error with the cause:

- a rank that raised (:func:`announce`, or an uncaught exception, :mod:`hybridshard.runtime.faults.exits`):
  ``rank 1 raised ValueError: a bad batch``;
- a rank that finished and left: ``rank 1 finished after 4 steps and left ...``;
- ranks that answer nothing: ``rank 1 was lost (killed, crashed or hung ...)``;
- every rank alive: the ranks issued different collectives, or the network failed.

Then every rank's answer, one line each, what to do, and the backend's text last (failure path
only). If the store lived in a lost rank 0 ([Note: restarts] in hybridshard/launcher/settings.py),
the error says that nothing can be read.

[Note: a stuck collective with a lost peer]
Some failures raise nothing where the collective was issued: on NCCL a collective whose peer died
or hung stays queued until the process group's timeout ([Note: NCCL faults] in
hybridshard/launcher/settings.py), and on gloo a peer that hangs with its sockets open holds the
others as long. So the watchdog thread (:mod:`hybridshard.runtime.faults.watchdog`) asks every rank
where it is, once per collective still in flight after ``HYBRIDSHARD_FAULT_SECONDS`` (60 by default;
0: off). Every rank of the group beating: nothing happens (the hang report comes later). One that
raised, left, or whose heartbeat stood still twice (3 s, then 9 s more): the rank logs the message a
failing collective raises, publishes that it failed and stops with status 1, minutes before the
timeout, so the launcher stops or restarts the job and every log names the lost rank.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch.distributed as dist

from hybridshard.runtime.faults import causes, partition, peers
from hybridshard.runtime.faults.peers import table
from hybridshard.runtime.faults.rank_state import current
from hybridshard.runtime.trace.position import current_where
from hybridshard.topology.groups import group_ranks

logger = logging.getLogger(__name__)

__all__ = ["CollectiveError", "announce", "collective_failed", "first_line", "peers_gone", "stop_now",
           "write_error_file"]


class CollectiveError(RuntimeError):
    """A collective failed: the consequence of what another rank did (the message says what)."""

RESTART = _RESTART = ("The job's collectives are out of step and it cannot continue: restart it (hybridshard launch "
            "--max-restarts N restarts every rank) and resume from the last checkpoint.")


def first_line(err: BaseException | str) -> str:
    text = str(err).strip()
    return text.splitlines()[0] if text else (type(err).__name__ if isinstance(err, BaseException) else "")


def announce(error: BaseException) -> None:
    """Tell the other ranks that this rank raised ``error`` (before raising it), so that their failing
    collectives name the cause: ``rank 1 raised ValueError: ...``. A :class:`CollectiveError` is a
    consequence, not a cause: it is published as this rank having failed."""
    rank = peers.identity()[0]
    if isinstance(error, CollectiveError):
        peers.publish("failed", f"rank {rank} failed too: {first_line(error)}")
    else:
        text = f"rank {rank} raised {type(error).__name__}: {first_line(error)}"
        peers.publish("raised", text)
        causes.publish(text)  # see [Note: keeping the causes] in hybridshard.runtime.faults.causes


def collective_failed(kind: str, group_label: str, group: dist.ProcessGroup | None, err: BaseException) -> CollectiveError:
    """The error to raise when ``kind`` on ``group`` failed with ``err``; see [Note: naming the lost rank]."""
    me, ranks, where = dist.get_rank(), group_ranks(group), current_where().describe()
    mine = f"{kind} on the {group_label} group (ranks {peers.ranks_text(ranks)})"
    reports = peers.ask_everyone({"state": "failed", "text": f"rank {me}: {mine} failed ({where})",
                                  "ranks": ranks, "call": current_where().call})
    if reports is None:
        host = ("rank 0's process, so rank 0 is probably the lost one"
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else "the rendezvous host")
        cause = (f"rank {me}: {mine} failed ({where}), and the job's store could not be reached to learn "
                 f"why; the store lives in {host}.")
        kept = causes.kept()  # read before the store went: see [Note: keeping the causes]
        cut = partition.store_lost_text(me)  # see [Note: a partition, not lost ranks]
        if cut is not None:
            cause = f"{cut}; so {mine} failed on rank {me} ({where})."
        elif kept:
            cause = (f"{next(iter(kept.values()))}; so {mine} failed on rank {me} ({where}) (kept by this rank: the "
                     f"job's store could not be reached after that; it lives in {host}).")
        return CollectiveError(f"{cause}\n{_RESTART}\nbackend: {first_line(err)}")
    cause = _cause(me, mine, where, reports, peers.REPORT_SECONDS) or (
        f"rank {me}: {mine} failed ({where}) while every rank is alive: the ranks issued different "
        "collectives (a different number of forwards/backwards or no_sync blocks, or a collective on "
        "some ranks only; HYBRIDSHARD_DEBUG=1 checks each one), or the network failed.")
    return CollectiveError(f"{cause}\nwhere every rank is:\n{table(reports)}\n{_RESTART}\nbackend: {first_line(err)}")


def _cause(me: int, mine: str, where: str, reports: list[peers.Report], seconds: float) -> str | None:
    """The first line's cause: a rank that raised, left, or was lost; ``None`` when every rank is alive."""
    raised, done = peers.having(reports, ("raised",)), peers.having(reports, ("done",))
    lost = [r.rank for r in peers.having(reports, ("lost",))]
    if raised:
        return f"{raised[0].text}; so {mine} failed on rank {me} ({where})."
    if done:
        return (f"{done[0].text} and left, while rank {me} was still training ({where}): the ranks ran "
                f"different numbers of steps, and {mine} failed.")
    if lost:
        cut = partition.lost_racks_text(me, lost)  # see [Note: a partition, not lost ranks]
        if cut is not None:
            return f"{cut}; so {mine} failed on rank {me} ({where})."
        names = ", ".join(map(str, lost)) if len(lost) <= 16 else f"{', '.join(map(str, lost[:16]))} and {len(lost) - 16} more"
        return (f"rank{'s' if len(lost) > 1 else ''} {names} "
                f"{'were' if len(lost) > 1 else 'was'} lost (killed, crashed or hung: no answer within "
                f"{seconds:.0f}s); so {mine} failed on rank {me} ({where}).")
    return None


_GONE = ("raised", "failed", "done", "lost")


def peers_gone(kind: str, group_label: str, ranks: list[int], where: str, in_flight: float,
               mine: dict[str, Any], while_waiting: Callable[[], None] | None = None) -> str | None:
    """The message to stop with when this rank's ``kind`` has been in flight ``in_flight`` seconds and a
    rank of its group raised, left or is lost; ``None`` while every rank of the group is alive (see
    [Note: a stuck collective with a lost peer]). ``mine`` is this rank's answer to the ask; ``while_waiting``
    as in :func:`hybridshard.runtime.faults.peers.ask_everyone`."""
    me = peers.identity()[0]
    reports: list[peers.Report] | None = None
    seconds = peers.REPORT_SECONDS
    group = set(ranks)
    for seconds in (peers.REPORT_SECONDS, 3 * peers.REPORT_SECONDS):  # a silent rank is asked twice
        # The first look decodes only the ranks that are gone: the common case (nobody) stays cheap.
        brief = seconds == peers.REPORT_SECONDS
        reports = peers.ask_everyone(mine, seconds=seconds, while_waiting=while_waiting, brief=brief)
        if reports is None:
            cut = partition.store_lost_text(me)  # see [Note: a partition, not lost ranks]
            if cut is not None:
                return (f"{cut}; so {kind} on the {group_label} group (ranks {peers.ranks_text(ranks)}) cannot "
                        f"complete on rank {me} ({where}).\n{_RESTART}")
            return _kept_cause(me, kind, group_label, ranks, where, in_flight)
        gone = [r for r in peers.having(reports, _GONE) if r.rank in group and r.rank != me]
        if not gone:
            return None
        if any(r.state != "lost" for r in gone):
            if brief:  # it said so itself: nothing to confirm, but the message shows every rank
                reports = peers.ask_everyone(mine, seconds=seconds, while_waiting=while_waiting)
            break
    assert reports is not None
    text = f"{kind} on the {group_label} group (ranks {peers.ranks_text(ranks)})"
    cause = _cause(me, text, where, reports, seconds) or f"rank {me}: {text} cannot complete ({where})."
    return (f"{cause}\nwhere every rank is:\n{table(reports)}\nThe {kind} was still in flight after "
            f"{in_flight:.0f}s (HYBRIDSHARD_FAULT_SECONDS), so rank {me} stops now rather than at the process "
            f"group's timeout.\n{_RESTART}")


def _kept_cause(me: int, kind: str, group_label: str, ranks: list[int], where: str, in_flight: float) -> str | None:
    """:func:`peers_gone`'s message when the store is gone but a rank of the group raised before it went
    (see [Note: keeping the causes] in :mod:`hybridshard.runtime.faults.causes`); ``None`` without one."""
    kept = {r: text for r, text in causes.kept().items() if r in ranks and r != me}
    if not kept:
        return None
    return (f"{next(iter(kept.values()))}; so {kind} on the {group_label} group (ranks {ranks}) cannot complete on "
            f"rank {me} ({where}) (kept by this rank: the job's store could not be reached after that).\nThe {kind} "
            f"was still in flight after {in_flight:.0f}s (HYBRIDSHARD_FAULT_SECONDS), so rank {me} stops now rather "
            f"than at the process group's timeout.\n{_RESTART}")


def stop_now(status: int = 1) -> None:
    """End the process at once with ``status``, its output flushed: the job cannot go on and waiting
    for the backend's timeout would only hide why. A rank of the scale harness is stopped by its
    plane's ``on_stop`` instead (see [Note: one control plane per rank] in
    :mod:`hybridshard.runtime.faults.rank_state`)."""
    on_stop = current().on_stop
    if on_stop is not None:
        on_stop(status)
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001
            pass
    os._exit(status)


def write_error_file(error: BaseException, *, consequence: bool) -> None:
    """Write torchrun's error file for this worker (``TORCHELASTIC_ERROR_FILE``, the format of torch's
    ``@record``) for the launcher's summary, adding ``extraInfo.hybridshard``: a float time and whether
    ``error`` is a consequence of another rank's failure (see [Note: run directory] in
    :mod:`hybridshard.launcher.runlog`). Nothing when there is no such file to write or one exists."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or os.path.exists(path):
        return
    now = time.time()
    stack = "".join(traceback.format_exception(type(error), error, error.__traceback__))
    data = {"message": {"message": f"{type(error).__name__}: {error}", "extraInfo": {
        "py_callstack": stack, "timestamp": str(int(now)), "hybridshard": {"time": now, "consequence": consequence}}}}
    try:
        with open(f"{path}.{os.getpid()}.tmp", "w") as f:
            json.dump(data, f)
        os.replace(f"{path}.{os.getpid()}.tmp", path)
    except OSError:
        logger.debug("could not write the error file %s", path, exc_info=True)
