"""The opt-in check that every rank of a group is about to issue the same collective.

[Note: debug agreement check]
Ranks that run a different number of forwards or backwards in a step, or a different ``no_sync``
pattern, issue different collectives; paired up by order they silently mix unrelated tensors of the
same size or wait forever. With ``HYBRIDSHARD_DEBUG=1`` (or ``shard(..., debug=True)``), each
collective is preceded by an all-gather of a small fingerprint in the same group: the kind, element
count, dtype, and where the rank is (step, forward, phase, unit; see
:mod:`hybridshard.runtime.position`). The fingerprints always pair (same size), so a disagreement
raises a ``ValueError`` on every member naming what each rank was doing. It doubles the number of
collectives (each one tiny), so it is for finding such a bug, not for production runs.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

from hybridshard.runtime import faults
from hybridshard.runtime.position import PHASES, current_where

logger = logging.getLogger(__name__)

__all__ = ["check", "enabled", "set_debug"]

_DEBUG = {"on": os.environ.get("HYBRIDSHARD_DEBUG", "") not in ("", "0")}
_KINDS = ("all_gather", "reduce_scatter", "all_reduce", "broadcast", "all_to_all")
_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.uint8)


def enabled() -> bool:
    return _DEBUG["on"]


def set_debug(on: bool) -> None:
    _DEBUG["on"] = bool(on)


def check(kind: str, group_label: str, group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """All-gather this collective's fingerprint in ``group`` and raise if the members disagree."""
    w = current_where()
    dtype_code = _DTYPES.index(tensor.dtype) if tensor.dtype in _DTYPES else len(_DTYPES)
    mine = torch.tensor(
        [_KINDS.index(kind), tensor.numel(), dtype_code, w.step, w.forward, PHASES.index(w.phase), w.unit],
        dtype=torch.int64,
        device=tensor.device,
    )
    size = dist.get_world_size(group)
    everyone = torch.empty(size * mine.numel(), dtype=torch.int64, device=tensor.device)
    dist.all_gather_into_tensor(everyone, mine, group=group)
    rows = everyone.view(size, -1).tolist()
    if all(row == rows[0] for row in rows):
        return
    ranks = faults.group_ranks(group)
    described = "; ".join(
        f"rank {r}: {_KINDS[k]} of {n} elements at step {s}, forward {f}, {PHASES[p]}, unit {u}"
        for r, (k, n, _, s, f, p, u) in zip(ranks, rows)
    )
    message = (
        f"ranks disagree on the next collective in the {group_label} group: {described}. Every rank must run "
        "the same number of forwards and backwards per step, with the same no_sync blocks and the same "
        "units taking part; look for a data-dependent branch or a micro-batch count that differs by rank"
    )
    faults.announce(message)  # ranks outside this group learn it when their own collectives fail
    raise ValueError(message)
