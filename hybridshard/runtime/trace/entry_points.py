"""The package's collective entry points, and where the main thread is blocked.

Every public call that runs collectives on every rank of the job (``full_state_dict``,
``save_checkpoint``, ``check_replicas`` ...; the ones marked by
:func:`hybridshard.runtime.trace.position.api_call`) is *entered* here: the main thread's stack of calls,
each with a per-rank sequence number (this rank's ``n``-th call of that entry point). Entering costs a counter and
a list append, nothing on the store.

[Note: blocked in a collective]
The watchdog thread reads the main thread's innermost Python frame (``sys._current_frames()``) about
once a second. The main thread counts as *blocked in a collective* while that frame stays the same
frame at the same line and is either

- a frame of ``torch.distributed.distributed_c10d`` (or its ``c10d_logger`` wrapper): a blocking
  c10d call, the user's ``dist.barrier()`` or ``all_gather_object`` as much as the package's own; or
- a frame of this package while one of its collectives is registered in flight (see
  [Note: hang report] in :mod:`hybridshard.runtime.faults.watchdog`): the runtime waiting on a handle.

Anything else is *running*: computing, sleeping or stalled outside any collective (a C call of its
own, ``time.sleep``, a long kernel, I/O), which only makes a rank late. The frame must stay put
because a computing thread changes frames and lines all the time, while a thread blocked in C++
keeps its last Python frame. Not seen as blocked: a user's own ``work.wait()`` on an asynchronous
c10d handle (its frame is the user's), which only leaves such a hang to the hang report.

[Note: no frame kept]
The watchdog never keeps a reference to the main thread's frame between polls. A frame object that
outlives its call keeps its locals and, through ``f_back``, every caller's locals as they were when
each returned: holding the frame of a wait inside the gradient path kept a backward's gradient
shards (the executor's job list, frames up) alive for up to a poll after ``zero_grad(set_to_none=True)``,
on a GPU a step's worth of memory at the next forward. "The same frame" is therefore its address
while the main thread is in it (the interpreter keeps a frame object alive as long as its call
runs), with the first collective in flight (its kind, group and issue time) for the package's own
waits. A new call at the same line may reuse the address of the last one's frame; every poll must
then land inside one of them for the episode to go on, which happens only while those calls
complete one after another, so with every rank taking part, and the mismatch check needs other
ranks blocked in a different call for the whole limit.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

__all__ = ["Blocked", "Entry", "MainThreadWatch", "enter", "entries", "leave"]

_MAIN = threading.main_thread()
_TORCH_DISTRIBUTED = os.path.join("torch", "distributed") + os.sep
_C10D_FILES = ("distributed_c10d.py", "c10d_logger.py")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # hybridshard/
_TORCH = os.sep + "torch" + os.sep


@dataclass(frozen=True)
class Entry:
    """One entry into a collective entry point on this rank."""

    name: str
    seq: int
    """This rank's ``seq``-th call of ``name``: the same on every rank when every rank makes the same calls
    (counted per name, so one call's count going astray leaves the others' alone)."""

    def describe(self) -> str:
        return f"{self.name} (call #{self.seq} on this rank)"


_STACK: list[Entry] = []
_COUNTS: dict[str, int] = {}


def enter(name: str) -> Entry | None:
    """Record that the main thread entered entry point ``name``; the token for :func:`leave`.
    Other threads' calls are not recorded (only the main thread is watched)."""
    if threading.current_thread() is not _MAIN:
        return None
    _COUNTS[name] = seq = _COUNTS.get(name, 0) + 1
    entry = Entry(name, seq)
    _STACK.append(entry)
    return entry


def leave(entry: Entry | None) -> None:
    if entry is not None and _STACK and _STACK[-1] is entry:
        _STACK.pop()


def entries() -> tuple[Entry, ...]:
    """The entry points the main thread is in, outermost first."""
    return tuple(_STACK)


@dataclass(frozen=True)
class Blocked:
    """Where the main thread is, as the watchdog saw it (see [Note: blocked in a collective]).

    ``call`` names the collective it is blocked in (``barrier``, ``all_gather on the shard group``), ``""``
    while it runs; ``at`` is the ``file:line (function)`` of the innermost frame outside torch and this
    package (the user's call), ``inner`` that of the innermost Python frame; ``entries`` are the package's
    entry points it is inside, outermost first; ``since`` is the ``time.time()`` at which it entered this
    frame and line (its blocked episode began).
    """

    call: str
    at: str
    inner: str
    entries: tuple[Entry, ...]
    since: float

    @property
    def blocked(self) -> bool:
        return bool(self.call)

    def describe(self) -> str:
        inside = f"inside {self.entries[0].describe()}, " if self.entries else "in no entry point of the package, "
        if not self.blocked:
            return f"{inside}running at {self.at}"
        inner = f" (waiting at {self.inner})" if self.inner != self.at else ""
        return f"{inside}blocked in {self.call} at {self.at}{inner}"


def _where(frame: FrameType) -> str:
    return f"{_short(frame.f_code.co_filename)}:{frame.f_lineno} ({frame.f_code.co_name})"


def _short(path: str) -> str:
    """``hybridshard/...``, ``torch/...``, or relative to the working directory when under it."""
    if path.startswith(_PACKAGE):
        return os.path.relpath(path, os.path.dirname(_PACKAGE.rstrip(os.sep)))
    if _TORCH in path:
        return path[path.rindex(_TORCH) + 1:]
    cwd = os.getcwd() + os.sep
    return path[len(cwd):] if path.startswith(cwd) else path


def _is_c10d(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return _TORCH_DISTRIBUTED in path and path.endswith(_C10D_FILES)


def _is_ours_or_torch(frame: FrameType) -> bool:
    path = frame.f_code.co_filename
    return path.startswith(_PACKAGE) or _TORCH in path or "contextlib" in path


def _classify(frame: FrameType, pending: list[Any]) -> tuple[str, str]:
    """``(call, at)`` for the main thread's innermost ``frame``; ``call`` is ``""`` when it is not blocked."""
    at = frame
    while at.f_back is not None and _is_ours_or_torch(at):
        at = at.f_back
    if _is_c10d(frame):
        call, f = frame.f_code.co_name, frame
        while f is not None and _is_c10d(f):  # the outermost c10d function: the one the caller named
            if f.f_code.co_name != "wrapper":
                call = f.f_code.co_name
            f = f.f_back
        return call, _where(at)
    if frame.f_code.co_filename.startswith(_PACKAGE) and pending:
        first = pending[0]
        return f"{first.kind} on the {first.group} group", _where(at)
    return "", _where(at)


class MainThreadWatch:
    """Follows the main thread from one watchdog poll to the next (the watchdog thread only)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._since = time.time()

    def observe(self, pending: list[Any]) -> Blocked | None:
        """The main thread's state now; ``pending`` is the runtime's collectives in flight, oldest
        first. ``None`` when the main thread is gone."""
        frame = sys._current_frames().get(_MAIN.ident)  # noqa: SLF001 - the documented way to see another thread
        if frame is None:
            return None
        call, at = _classify(frame, pending)
        stack = entries()
        # See [Note: no frame kept]: the frame is known by its address, never held.
        first = (pending[0].kind, pending[0].group, getattr(pending[0], "started", None)) if pending else None
        key = (frame.f_code, frame.f_lineno, id(frame), bool(call), stack, first)
        if key != self._key:
            self._key, self._since = key, time.time()
        return Blocked(call, at, _where(frame), stack, self._since)

