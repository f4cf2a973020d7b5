"""Where this rank is in training: step, forward, phase and unit, kept up to date by the runtime.

Read by the checks that describe a rank to its peers (:mod:`hybridshard.runtime.agreement`). The
communication thread finishes a unit's gradient while the main thread has moved on, so it works
under a snapshot of the position it was handed (:func:`working_for`).
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

__all__ = ["PHASES", "Where", "current_where", "snapshot", "where", "working_for"]

PHASES = ("setup", "forward", "backward", "no_sync backward", "other")


@dataclass
class Where:
    """Where this rank is; see the module docstring."""

    step: int = 0
    """Syncing backwards finished so far (one per optimizer step)."""
    forward: int = 0
    """Forwards since the last syncing backward."""
    phase: str = "setup"
    """One of :data:`PHASES`."""
    unit: int = -1
    """Index of the unit whose hook ran last."""

    def start_forward(self) -> None:
        self.forward += 1
        self.phase = "forward"

    def end_backward(self, synced: bool) -> None:
        self.phase = "other"
        if synced:
            self.step += 1
            self.forward = 0


where = Where()
"""The main thread's position (the one the runtime's hooks update)."""
_THREAD = threading.local()


def current_where() -> Where:
    """:data:`where`, or what the calling thread was told it works for (see :func:`working_for`)."""
    return getattr(_THREAD, "where", None) or where


def snapshot() -> Where:
    """A copy of the current position, for work another thread finishes later."""
    w = current_where()
    return Where(step=w.step, forward=w.forward, phase=w.phase, unit=w.unit)


@contextlib.contextmanager
def working_for(position: Where) -> Iterator[None]:
    """Collectives issued by this thread inside the block describe themselves as ``position``."""
    _THREAD.where = position
    try:
        yield
    finally:
        _THREAD.where = None
