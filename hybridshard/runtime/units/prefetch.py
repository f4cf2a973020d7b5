"""Prefetching: gather the next units while the current one computes, in forward and in backward.

[Note: prefetch order]
The runtime cannot know which unit runs next until it has seen a step, so the prefetcher records the
order units start in: forward pre-hooks per forward (a new forward begins at the root's pre-hook)
and backward pre-hooks per backward. From the second forward (and backward) on, when unit ``k``
starts it issues its own all-gather if not already in flight, then those of the next ``depth`` units
of the recorded order, and only then waits for ``k``'s; so the gathers for ``k+1 .. k+depth`` run
while ``k`` computes. Every rank runs the same model, so every rank records the same order and
issues the same all-gathers in the same order (prefetching never makes ranks disagree).

A changed order (a branch not taken, a different number of layers) only costs time: a unit gathered
ahead and then not used is freed at the end of that forward (a ZeRO-3 unit) or of that backward,
and the order recorded this time replaces the old one. ``depth`` bounds how many gathers the
prefetcher keeps ahead of the unit computing (``limit_all_gathers`` in FSDP1 terms): with depth
``d`` at most ``d + 1`` ZeRO-3 units are gathered at once, on top of the root and ZeRO-2 units,
which stay gathered by design. ``depth=0`` turns prefetching off.

Units gathered for activation-checkpoint recomputation inside backward are not recorded: that
gather is already done by the backward pre-hook (see [Note: recomputation in backward]).
"""

from __future__ import annotations

import enum
import logging
import zlib
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["Pass", "Prefetcher"]


class Pass(enum.Enum):
    FORWARD = "forward"
    BACKWARD = "backward"


class _Order:
    """The order units started in during the last complete pass, and the one being recorded."""

    def __init__(self) -> None:
        self.recorded: list[int] = []
        self._next: dict[int, list[int]] = {}
        self.current: list[int] = []
        """The order of the pass running now (or last run), as recorded so far."""
        self._seen: set[int] = set()

    def start(self) -> None:
        """A new pass begins: the one recorded so far becomes the order to follow."""
        if self.current and self.current != self.recorded:
            if self.recorded:
                logger.debug("unit order changed: %s -> %s", self.recorded, self.current)
            self.recorded = self.current
            self._next = {u: self.recorded[i + 1 :] for i, u in enumerate(self.recorded)}
        self.current, self._seen = [], set()

    def visited(self, index: int) -> bool:
        """Whether ``index`` started in the pass being recorded."""
        return index in self._seen

    def visit(self, index: int) -> list[int]:
        """Record ``index``; the units that followed it last time."""
        if index not in self._seen:
            self._seen.add(index)
            self.current.append(index)
        return self._next.get(index, [])


class Prefetcher:
    """Gathers up to ``depth`` units ahead of the one computing; see [Note: prefetch order]."""

    def __init__(self, units: Sequence[Unit], depth: int) -> None:
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise ValueError(f"prefetch must be an int >= 0 (units gathered ahead; 0 = off); got {depth!r}")
        self.units = list(units)
        self.depth = depth
        self._orders = {Pass.FORWARD: _Order(), Pass.BACKWARD: _Order()}

    def digest(self) -> int:
        """A checksum of every unit order recorded so far (the step check compares it across ranks)."""
        orders = [(o.recorded, o.current) for o in self._orders.values()]
        return zlib.crc32(repr(orders).encode())

    def begin(self, phase: Pass) -> None:
        self._orders[phase].start()

    def before_unit(self, phase: Pass, unit: Unit) -> None:
        """``unit`` is about to gather and compute: issue its gather and the next ones, in order."""
        following = self._orders[phase].visit(unit.index)
        if not self.depth or not following:
            return
        unit.prefetch()
        ahead = 0
        order = self._orders[phase]
        for index in following:
            if order.visited(index):
                # Already computed in this pass (the order changed): gathering it again would give
                # this rank one collective more than the others.
                continue
            other = self.units[index]
            if ahead == self.depth:
                other.stage()  # an offloaded shard's copy to the device, one unit further ahead
                break
            if other.prefetch() or other.prefetched:
                ahead += 1

    def end_forward(self) -> None:
        """Free ZeRO-3 units gathered ahead during this forward that it did not use."""
        for unit in self.units:
            unit.flat.drop_staged()
            if unit.prefetched and unit.reshard_after_forward and unit.index != 0:
                unit.reshard()
