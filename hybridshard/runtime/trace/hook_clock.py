"""The runtime's one clock for its hooks: each unit's hook time, and what an observer reads.

[Note: one hook clock]
Every entry point of the runtime's hooks (the forward pre/post hooks, the backward hooks, the
end-of-backward callback) runs inside :func:`timed`, which reads ``perf_counter`` once on entry and
once on exit. An entry nested in another on the same thread (a frozen part resharded from its
trainable unit's hook) is charged to its own unit and taken out of the outer unit's time, so the
units' ``hook_seconds`` (``comm_stats``) add up to the outermost entries' wall time. An observer set
with :func:`observe` (``hybridshard bench``'s clock) gets each *outermost* entry's wall time and the
thread's CPU time in it (``thread_time``, read only while an observer is set), and the CPU time of
the communication thread's jobs (:func:`thread_job`): the runtime's hooks are timed once, here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator, Protocol

__all__ = ["HookObserver", "observe", "thread_job", "timed"]


class HookObserver(Protocol):
    def hook_entered(self) -> None:
        """An outermost hook entry starts on this thread."""

    def hook_exited(self, entry: str, wall_seconds: float, cpu_seconds: float) -> None:
        """An outermost hook entry ended: its wall time and the thread's CPU time in it."""

    def thread_job(self, entry: str, cpu_seconds: float) -> None:
        """A job on the runtime's own thread ended: the thread's CPU time in it."""


class _Timed(Protocol):
    hook_seconds: float


_local = threading.local()
_observer: HookObserver | None = None


def observe(observer: HookObserver | None) -> HookObserver | None:
    """Send every outermost entry's times to ``observer`` (``None``: to nobody); the previous observer."""
    global _observer
    previous, _observer = _observer, observer
    return previous


def _open_entries() -> list[list[float]]:
    """This thread's open entries, outermost first: ``[started, seconds of the entries nested in it]``."""
    stack = getattr(_local, "stack", None)
    if stack is None:
        stack = _local.stack = []
    return stack


@contextlib.contextmanager
def timed(unit: _Timed | None, entry: str) -> Iterator[None]:
    """Time one hook entry into ``unit.hook_seconds`` (``None``: no unit's); see [Note: one hook clock]."""
    stack = _open_entries()
    observer = _observer if not stack else None
    if observer is not None:
        observer.hook_entered()
        cpu_started = time.thread_time()
    frame = [time.perf_counter(), 0.0]
    stack.append(frame)
    try:
        yield
    finally:
        stack.pop()
        wall = time.perf_counter() - frame[0]
        if unit is not None:
            unit.hook_seconds += wall - frame[1]
        if stack:
            stack[-1][1] += wall
        elif observer is not None:
            observer.hook_exited(entry, wall, time.thread_time() - cpu_started)


@contextlib.contextmanager
def thread_job(entry: str) -> Iterator[None]:
    """A job on the runtime's own thread: its CPU time goes to the observer, if one is set."""
    observer = _observer
    if observer is None:
        yield
        return
    cpu_started = time.thread_time()
    try:
        yield
    finally:
        observer.thread_job(entry, time.thread_time() - cpu_started)
