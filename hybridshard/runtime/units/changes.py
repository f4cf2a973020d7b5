"""Finding parameters a user changed while their unit stayed gathered, and saying which.

A unit that keeps its gathered parameters from forward to backward (ZeRO-2 units, the root) would
compute its gradient for values the parameters no longer have if one was replaced, changed in
place, or stepped by the optimizer in between. :func:`check_unchanged` runs before such a unit's
backward and raises a ``RuntimeError`` naming the parameter; see [Note: stale gathers] in
:mod:`hybridshard.runtime.units.unit`.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from hybridshard.runtime.faults import errors

if TYPE_CHECKING:
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["check_unchanged"]


def check_unchanged(unit: Unit) -> None:
    """Raise if a parameter of ``unit`` was replaced or changed in place while it stayed gathered."""
    if unit.views is None:
        return
    slots = unit.flat.layout.slots
    for i, (view, holders) in enumerate(zip(unit.views, unit.bindings)):
        for mod, attr in holders:
            if mod._parameters.get(attr) is not view:
                _raise(unit, slots[i].name, "replaced")
    if unit.flat.unsharded._version != unit.views_version:
        _raise(unit, _find_changed(unit), "changed in place")
    versions = unit.flat.master_versions()
    if versions != unit.gathered_versions:  # see [Note: stale gathers]
        moved = [i - 1 for i, (a, b) in enumerate(zip(versions, unit.gathered_versions)) if a != b]
        name = slots[moved[0]].name if moved[0] >= 0 else _one_of(slots)
        _raise(unit, name, "updated through the optimizer's parameters")


def _one_of(slots: Any) -> str:
    return "one of " + ", ".join(s.name for s in slots)


def _find_changed(unit: Unit) -> str:
    """Name the first parameter whose gathered values left this rank's master shard.

    Local on purpose: the change may have happened on this rank only, and a collective that only
    this rank enters would hang. A change outside this rank's chunk names every candidate.
    """
    local = unit.flat.local_chunk()
    master = unit.flat.gather_input()
    slots = unit.flat.layout.slots
    for slot, part in zip(slots, unit.flat.layout.local_slices()):  # the whole chunk, not the owned range
        lo = part.shard_offset
        if part.numel and not torch.equal(local[lo : lo + part.numel], master[lo : lo + part.numel]):
            return slot.name
    return _one_of(slots)


def _raise(unit: Unit, name: str, how: str) -> None:
    """Raise here, and leave the message for the peers: the change may be on this rank only
    (see [Note: naming the lost rank] in :mod:`hybridshard.runtime.faults.errors`)."""
    message = (
        f"parameter {name!r} of unit {unit.name!r} was {how} between forward and backward; this unit "
        "keeps its gathered parameters until backward ends (ZeRO-2 units and the root unit do), so the "
        "change would be lost or corrupt the gradient. Change parameters only after backward (e.g. in the "
        "optimizer step), or use FULL_SHARD / HYBRID_SHARD for the unit"
    )
    error = RuntimeError(message)
    errors.announce(error)
    raise error
