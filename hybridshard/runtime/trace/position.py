"""Where this rank is in training: API call, step, forward, phase and unit, kept up to date by the runtime.

Read by everything that describes a rank to its peers: the step check and the debug check
(:mod:`hybridshard.runtime.comm.agreement`), fault messages (:mod:`hybridshard.runtime.faults.errors`) and the
hang report (:mod:`hybridshard.runtime.faults.watchdog`). The communication thread finishes a unit's
gradient while the main thread has moved on, so it works under a snapshot of the position it was
handed (:func:`working_for`).
"""

from __future__ import annotations

import contextlib
import functools
import threading
from dataclasses import dataclass
from typing import Any, Callable, Iterator, TypeVar

from hybridshard.runtime.trace import entry_points

__all__ = ["PHASES", "Where", "api_call", "current_where", "in_call", "snapshot", "where", "working_for"]

F = TypeVar("F", bound=Callable[..., Any])

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
    call: str = ""
    """The API call running (``"full_state_dict"``, ``"save_checkpoint"`` ...); empty in training."""

    def describe(self) -> str:
        """``"step 3, forward 1, unit 2"`` (or ``"in full_state_dict, step 3, ..."``)."""
        parts = [f"in {self.call}"] if self.call else []
        parts.append(f"step {self.step}")
        if self.phase in ("forward", "backward", "no_sync backward"):
            parts.append(f"{self.phase} {self.forward}" if self.phase == "forward" else self.phase)
            if self.unit >= 0:
                parts.append(f"unit {self.unit}")
        elif self.phase == "setup":
            parts.append("setup")
        return ", ".join(parts)

    def start_forward(self) -> None:
        self.forward += 1
        self.phase = "forward"
        self.unit = -1

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
    return Where(**vars(current_where()))  # what dataclasses.replace does, with less work per collective


@contextlib.contextmanager
def in_call(name: str) -> Iterator[None]:
    """Mark the block as the API call ``name`` (collective calls outside training steps)."""
    outer, where.call = where.call, name
    entry = entry_points.enter(name)  # see [Note: entry point on some ranks only] in hybridshard.runtime.faults.mismatch
    try:
        yield
    finally:
        entry_points.leave(entry)
        where.call = outer


def api_call(fn: F) -> F:
    """Run ``fn`` marked as the API call of its name (see :func:`in_call`)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        with in_call(fn.__name__):
            return fn(*args, **kwargs)

    return wrapper  # type: ignore[return-value]


@contextlib.contextmanager
def working_for(position: Where) -> Iterator[None]:
    """Collectives issued by this thread inside the block describe themselves as ``position``."""
    _THREAD.where = position
    try:
        yield
    finally:
        _THREAD.where = None
