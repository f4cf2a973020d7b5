"""The order in which this process issues its collectives, per communicator and in total.

[Note: one issue order per communicator]
A NCCL communicator runs its kernels in the order they were enqueued, and two communicators'
kernels can block each other on the device. So every rank must enqueue the collectives of each
communicator in the same order, and, since a kernel waiting for a peer can hold back another
communicator's kernel behind it on the same device, the interleaving of all of them must agree
too. Host threads issuing in racing orders break that even when each one alone is orderly.
:func:`record_issue_order` lets a test see what a step issued: each entry names the communicator
(by its role: "shard", "replicate", "world"), the collective, its element count and dtype, the
issuing thread and the phase the rank was in (see :mod:`hybridshard.runtime.trace.position`). Entries
come in the order the process issued them, across threads.

Recording costs one lock and one append per collective, and only inside a block.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Iterator

import torch

from hybridshard.runtime.trace.position import current_where

logger = logging.getLogger(__name__)

__all__ = ["Issue", "IssueLog", "note", "record_issue_order"]


@dataclass(frozen=True)
class Issue:
    """One collective as it was issued."""

    group: str
    """The communicator's role ("shard", "replicate", "world", ...)."""
    kind: str
    numel: int
    dtype: str
    thread: str
    """The name of the host thread that issued it."""
    phase: str
    """Where the rank was: "forward", "backward", ... (see :data:`hybridshard.runtime.trace.position.PHASES`)."""
    stream: str = ""
    """On the emulated device: the side stream it was queued on ("" otherwise: the current stream)."""
    waited_by: list[str] = field(default_factory=list, compare=False)
    """On the emulated device: ``"<stream> in unit <name>"`` for each stream that waited on it first
    ("compute" is the host); see :mod:`hybridshard.runtime.comm.executors.emulate`."""

    @property
    def signature(self) -> tuple[str, str, int, str]:
        """What every rank must agree on: communicator, collective, elements, dtype."""
        return (self.group, self.kind, self.numel, self.dtype)


@dataclass
class IssueLog:
    """The collectives issued inside one :func:`record_issue_order` block, in issue order."""

    issues: list[Issue] = field(default_factory=list)

    def by_group(self) -> dict[str, list[Issue]]:
        out: dict[str, list[Issue]] = {}
        for issue in self.issues:
            out.setdefault(issue.group, []).append(issue)
        return out

    def signatures(self) -> list[tuple[str, str, int, str]]:
        """The whole interleaved order, without threads: identical on every rank when it is safe."""
        return [i.signature for i in self.issues]

    def threads_per_phase(self) -> dict[tuple[str, str], set[str]]:
        """``(group, phase) -> threads that issued on it``: one thread each when issuing is safe."""
        out: dict[tuple[str, str], set[str]] = {}
        for issue in self.issues:
            out.setdefault((issue.group, issue.phase), set()).add(issue.thread)
        return out


_ACTIVE: list[IssueLog] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def record_issue_order() -> Iterator[IssueLog]:
    """Record every collective this process issues inside the block; see [Note: one issue order
    per communicator]."""
    log = IssueLog()
    with _LOCK:
        _ACTIVE.append(log)
    try:
        yield log
    finally:
        with _LOCK:
            _ACTIVE.remove(log)


def note(group: str, kind: str, tensor: torch.Tensor, stream: str = "") -> Issue | None:
    """Called for every collective as it is issued (by :mod:`hybridshard.runtime.comm.collectives` and
    the step check); the entry, or ``None`` outside a recording block."""
    if not _ACTIVE:
        return None
    issue = Issue(group, kind, tensor.numel(), str(tensor.dtype).replace("torch.", ""),
                  threading.current_thread().name, current_where().phase, stream)
    with _LOCK:
        for log in _ACTIVE:
            log.issues.append(issue)
    return issue
