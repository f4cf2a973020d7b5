"""Faults between ranks: a collective that fails names its group and the lost ranks, a rank that
raises tells the others why, and (opt-in) every collective first checks that its group agrees.

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

[Note: debug agreement check]
Ranks that run a different number of forwards or backwards in a step, or a different ``no_sync``
pattern, issue different collectives; paired up by order they silently mix unrelated tensors of the
same size or wait forever. With ``HYBRIDSHARD_DEBUG=1`` (or ``shard(..., debug=True)``), each
collective is preceded by an all-gather of a small fingerprint in the same group: the kind, element
count, dtype, and where the rank is (step, forward, phase, unit). The fingerprints always pair (same
size), so a disagreement raises a ``ValueError`` on every member naming what each rank was doing.
It doubles the number of collectives (each one tiny), so it is for finding such a bug, not for
production runs.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

__all__ = ["Where", "announce", "collective_failed", "debug_enabled", "set_debug", "where"]

REPORT_SECONDS = 3.0
"""How long a rank whose collective failed waits for its peers to report before naming the others lost."""
_KEY = "hybridshard/fault/"
_SURVIVOR = "survivor"


def _store() -> Any:
    try:
        return dist.distributed_c10d._get_default_store()
    except Exception:  # noqa: BLE001 - no store: the error is still raised, without the names
        return None


def _group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    if group is None or group is dist.group.WORLD:
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
    ranks = _group_ranks(group)
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


# -- debug agreement check ------------------------------------------------------------------------

_DEBUG = {"on": os.environ.get("HYBRIDSHARD_DEBUG", "") not in ("", "0")}
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
_PHASES = ("setup", "forward", "backward", "no_sync backward", "other")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)


@dataclass
class Where:
    """Where this rank is, for the debug fingerprint: maintained by the runtime."""

    step: int = 0
    """Syncing backwards finished so far (one per optimizer step)."""
    forward: int = 0
    """Forwards since the last syncing backward."""
    phase: str = "setup"
    unit: int = -1


where = Where()
_THREAD = threading.local()


def current_where() -> Where:
    """:data:`where`, or what the calling thread was told it works for (see :func:`working_for`)."""
    return getattr(_THREAD, "where", None) or where


@contextlib.contextmanager
def working_for(snapshot: Where) -> Iterator[None]:
    """Collectives issued by this thread inside the block describe themselves as ``snapshot``: the
    communication thread finishes a unit's gradient while the main thread has moved on."""
    _THREAD.where = snapshot
    try:
        yield
    finally:
        _THREAD.where = None


def debug_enabled() -> bool:
    return _DEBUG["on"]


def set_debug(on: bool) -> None:
    _DEBUG["on"] = bool(on)


def check_agreement(kind: str, group_label: str, group: dist.ProcessGroup | None, tensor: torch.Tensor) -> None:
    """All-gather this collective's fingerprint in ``group`` and raise if the members disagree."""
    w = current_where()
    dtype_code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor(
        [_KINDS.index(kind), tensor.numel(), dtype_code, w.step, w.forward, _PHASES.index(w.phase), w.unit],
        dtype=torch.int64,
        device=tensor.device,
    )
    size = dist.get_world_size(group)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=tensor.device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    ranks = _group_ranks(group)
    described = "; ".join(
        f"rank {r}: {_KINDS[k]} of {n} elements at step {s}, forward {f}, {_PHASES[p]}, unit {u}"
        for r, (k, n, _, s, f, p, u) in zip(ranks, rows)
    )
    message = (
        f"ranks disagree on the next collective in the {group_label} group: {described}. Every rank must run "
        "the same number of forwards and backwards per step, with the same no_sync blocks and the same "
        "units taking part; look for a data-dependent branch or a micro-batch count that differs by rank"
    )
    announce(message)  # ranks outside this group learn it when their own collectives fail
    raise ValueError(message)
