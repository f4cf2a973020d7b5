"""Faults between ranks: every error says first which rank did what, then the details.

[Note: naming the lost rank]
When a rank dies (killed, or raised and exited), its peers' pending collective fails: at once with
gloo ("connection reset by peer"), after the process group's timeout with NCCL or when the rank is
alive but elsewhere. The backend's message names an address at best. So a rank whose collective
failed asks every rank where it is through the job's store (see [Note: asking every rank where it
is] in :mod:`hybridshard.runtime.peers`) and builds its error from the answers, cause first:

- a rank that raised (one of the runtime's errors, :func:`announce`, or any uncaught exception, see
  :mod:`hybridshard.runtime.exits`): ``rank 1 raised ValueError: a bad batch``;
- a rank that finished its training and left: ``rank 1 finished after 4 steps and left ...``;
- ranks that answer nothing: ``rank 1 was lost (killed or crashed ...)``;
- every rank alive: the ranks issued different collectives, or the network failed.

The first line says that; then every rank's answer, one line each; then what to do; the backend's
own text comes last. All of this runs on the failure path only. When workers can restart, the store
lives in rank 0's process (see [Note: restarts] in hybridshard/launcher/settings.py); if rank 0 is
the lost one, nothing can be read and the error says so instead of naming every rank.
"""

from __future__ import annotations

import logging
import os

import torch.distributed as dist

from hybridshard.runtime import peers
from hybridshard.runtime.position import current_where
from hybridshard.runtime.watchdog import table
from hybridshard.topology.groups import group_ranks

logger = logging.getLogger(__name__)

__all__ = ["CollectiveError", "announce", "collective_failed", "first_line"]


class CollectiveError(RuntimeError):
    """A collective failed: the consequence of what another rank did (the message says what)."""

_RESTART = ("The job's collectives are out of step and it cannot continue: restart it (hybridshard launch "
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
        peers.publish("raised", f"rank {rank} raised {type(error).__name__}: {first_line(error)}")


def collective_failed(kind: str, group_label: str, group: dist.ProcessGroup | None, err: BaseException) -> CollectiveError:
    """The error to raise when ``kind`` on ``group`` failed with ``err``; see [Note: naming the lost rank]."""
    me, ranks, where = dist.get_rank(), group_ranks(group), current_where().describe()
    mine = f"{kind} on the {group_label} group (ranks {ranks})"
    reports = peers.ask_everyone({"state": "failed", "text": f"rank {me}: {mine} failed ({where})",
                                  "ranks": ranks, "call": current_where().call})
    if reports is None:
        host = ("rank 0's process, so rank 0 is probably the lost one"
                if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else "the rendezvous host")
        cause = (f"rank {me}: {mine} failed ({where}), and the job's store could not be reached to learn "
                 f"why; the store lives in {host}.")
        return CollectiveError(f"{cause}\n{_RESTART}\nbackend: {first_line(err)}")
    raised = [r for r in reports if r.state == "raised"]
    done = [r for r in reports if r.state == "done"]
    lost = [r.rank for r in reports if r.state == "lost"]
    if raised:
        cause = f"{raised[0].text}; so {mine} failed on rank {me} ({where})."
    elif done:
        cause = (f"{done[0].text} and left, while rank {me} was still training ({where}): the ranks ran "
                 f"different numbers of steps, and {mine} failed.")
    elif lost:
        cause = (f"rank{'s' if len(lost) > 1 else ''} {', '.join(map(str, lost))} "
                 f"{'were' if len(lost) > 1 else 'was'} lost (killed or crashed: no answer within "
                 f"{peers.REPORT_SECONDS:.0f}s); so {mine} failed on rank {me} ({where}).")
    else:
        cause = (f"rank {me}: {mine} failed ({where}) while every rank is alive: the ranks issued different "
                 "collectives (a different number of forwards/backwards or no_sync blocks, or a collective on "
                 "some ranks only; HYBRIDSHARD_DEBUG=1 checks each one), or the network failed.")
    return CollectiveError(f"{cause}\nwhere every rank is:\n{table(reports)}\n{_RESTART}\nbackend: {first_line(err)}")
