"""Faults between ranks: a collective that fails names its group and the lost ranks, and a rank that
raises tells the others why. The opt-in check that ranks agree on each collective is
:mod:`hybridshard.runtime.agreement`.

[Note: naming the lost rank]
When a rank dies (killed, or raised and exited), its peers' pending collective fails: at once with
gloo ("connection reset by peer"), after the process group's timeout with NCCL or when the rank is
alive but elsewhere. The backend's message names an address at best. So a rank whose collective
failed writes ``hybridshard/fault/<rank>`` into the job's store (the c10d store every rank already
shares) and waits up to :data:`REPORT_SECONDS` for the other members of the group to do the same.
Members that never write are the lost ones; a rank that raised one of the runtime's own errors
wrote its message there before raising (:func:`announce`), so its peers repeat it. All of this runs
on the failure path only: a healthy collective costs nothing extra. When workers can restart, the
store lives in rank 0's process (see [Note: restarts] in hybridshard/launcher/settings.py); if rank 0
is the lost one, nothing can be read and the error says so instead of naming every rank.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["REPORT_SECONDS", "announce", "collective_failed", "group_ranks"]

REPORT_SECONDS = 3.0
"""How long a rank whose collective failed waits for its peers to report before naming the others lost."""
_KEY = "hybridshard/fault/"
_SURVIVOR = "survivor"


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the error is still raised, without the names
        return None


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group``: this rank alone for ``None`` (no group), every rank for the world."""
    if group is None:
        return [dist.get_rank()]
    if group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def announce(message: str) -> None:
    """Leave this rank's error where its peers will find it if their collectives fail next."""
    store = _store()
    if store is None or not dist.is_initialized():
        return
    try:
        store.set(f"{_KEY}{dist.get_rank()}", message.encode())
    except Exception:  # noqa: BLE001 - the store may be gone too; the local error still stands
        logger.debug("could not publish the error to the store", exc_info=True)


def _peer_reports(ranks: list[int]) -> dict[int, str] | None:
    """Report this rank as a survivor, then collect what the group's members wrote (see the Note);
    ``None`` when the store cannot be reached."""
    store = _store()
    if store is None:
        return None
    me = dist.get_rank()
    keys = {r: f"{_KEY}{r}" for r in ranks}
    try:
        if not store.check([keys[me]]):
            store.set(keys[me], _SURVIVOR.encode())
        deadline = time.monotonic() + REPORT_SECONDS
        while time.monotonic() < deadline and not store.check(list(keys.values())):
            time.sleep(0.1)
        return {r: store.get(k).decode() for r, k in keys.items() if store.check([k])}
    except Exception:  # noqa: BLE001 - a lost store leaves the names out, not the error
        logger.debug("could not read peer reports from the store", exc_info=True)
        return None


def collective_failed(kind: str, group_label: str, group: dist.ProcessGroup | None, err: BaseException) -> RuntimeError:
    """The error to raise when ``kind`` on ``group`` failed with ``err``; see [Note: naming the lost rank]."""
    ranks = group_ranks(group)
    # The whole job reports, not only the group: the rank that died first may be in another group
    # (its death cascades, each failed rank leaving in turn).
    reports = _peer_reports(list(range(dist.get_world_size())))
    unreachable = reports is None
    reports = reports or {}
    lost = [] if unreachable else [r for r in range(dist.get_world_size()) if r not in reports]
    raised = {r: m for r, m in reports.items() if m != _SURVIVOR and r != dist.get_rank()}
    first_line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    parts = [f"{kind} on the {group_label} group (ranks {ranks}) failed on rank {dist.get_rank()}: {first_line}."]
    if raised:
        parts.append(" " + "; ".join(f"rank {r} raised: {m}" for r, m in sorted(raised.items())) + ".")
    if unreachable:
        where_ = ("rank 0's process, so rank 0 is probably the lost one"
                  if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "False" else "the rendezvous host")
        parts.append(f" The job's store could not be reached to learn which rank was lost; it lives in {where_}.")
    elif lost:
        parts.append(
            f" Rank{'s' if len(lost) > 1 else ''} {lost} did not report within {REPORT_SECONDS:.0f}s: lost (killed or "
            "crashed), or still blocked in a collective with a lost rank; read their logs."
        )
    elif not raised and reports:
        parts.append(
            " Every rank reported back, so none was lost: the ranks issued different collectives (a different "
            "number of forwards/backwards or no_sync blocks; rerun with HYBRIDSHARD_DEBUG=1 to see where), or the "
            "network failed."
        )
    parts.append(
        " The job's collectives are out of step and it cannot continue: restart it (hybridshard launch "
        "--max-restarts N restarts every rank) and resume from the last checkpoint."
    )
    return RuntimeError("".join(parts))
