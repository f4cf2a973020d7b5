"""``comm_stats``: what a sharded model's collectives moved, per group and operation, and its hook time.

Bytes are counted in the ring model (see :func:`hybridshard.runtime.counters.ring_bytes`): what one rank
sends. docs/performance.md gives the per-step formulas each strategy must meet; the tests assert them.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.nn as nn

from hybridshard.runtime.engine import get_runtime

logger = logging.getLogger(__name__)

__all__ = ["comm_stats"]


def comm_stats(model: nn.Module, *, reset: bool = False) -> dict[str, Any]:
    """This rank's communication since ``shard`` (or the last reset) for ``model``.

    Returns ``{"steps": n, "groups": {group: {op: {"calls", "elements", "bytes", "ring_bytes"},
    "total": {"ring_bytes"}}}, "hook_seconds": {unit name: seconds}, "gather_wait_seconds": {...}}``: ``steps`` counts backwards that
    reduced gradients (``no_sync`` ones excluded), ``bytes`` are the input tensors' bytes and
    ``ring_bytes`` what this rank sends in the ring model; ``hook_seconds`` is the wall time spent in
    the runtime's hooks per unit, and ``gather_wait_seconds`` the part of it spent gathering the
    unit's parameters (blocked on the all-gather); the rest is the hooks' own CPU work. ``reset=True`` zeroes everything after reading.
    Only the units' own collectives count (gathers, gradient reductions), not those of
    ``clip_grad_norm_``, checkpoints or state dicts.
    """
    runtime = get_runtime(model)
    out = {
        "steps": runtime.steps,
        "groups": runtime.stats.by_group(),
        "hook_seconds": {unit.name: unit.hook_seconds for unit in runtime.units},
        "gather_wait_seconds": {unit.name: unit.wait_seconds for unit in runtime.units},
    }
    if reset:
        runtime.reset_stats()
    return out
