"""Counting collectives: calls, elements and bytes per ``(kind, group name)``, in the ring model.

Two kinds of counters read every collective the runtime issues: :func:`count_collectives` blocks
(everything this process issues inside them) and a model's own :class:`CollectiveCounts` (its
units' gathers and gradient reductions, read by :func:`hybridshard.comm_stats`).
"""

from __future__ import annotations

import contextlib
import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterator

import torch

from hybridshard.comm_bytes import ring_bytes

__all__ = ["CollectiveCounts", "count_collectives", "record", "ring_bytes"]


@dataclass
class CollectiveCounts:
    """Collectives counted per ``(kind, group name)``: by a :func:`count_collectives` block, or by a
    model's runtime for :func:`hybridshard.comm_stats`."""

    calls: Counter = field(default_factory=Counter)
    """``(kind, group name) -> number of calls``."""
    elements: Counter = field(default_factory=Counter)
    """``(kind, group name) -> elements of the input tensors``."""
    bytes: Counter = field(default_factory=Counter)
    """``(kind, group name) -> bytes of the input tensors``."""
    ring_bytes: Counter = field(default_factory=Counter)
    """``(kind, group name) -> bytes this rank sends in the ring model`` (see :func:`ring_bytes`)."""

    def get(self, kind: str, group: str) -> int:
        return self.calls[(kind, group)]

    def record(self, kind: str, group: str, n: int, tensor: torch.Tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        key = (kind, group)
        self.calls[key] += 1
        self.elements[key] += tensor.numel()
        self.bytes[key] += nbytes
        self.ring_bytes[key] += ring_bytes(kind, n, nbytes)

    def reset(self) -> None:
        for counter in (self.calls, self.elements, self.bytes, self.ring_bytes):
            counter.clear()

    def by_group(self) -> dict[str, dict[str, dict[str, float]]]:
        """``{group: {kind: {"calls", "elements", "bytes", "ring_bytes"}}}``, plus a ``"total"``
        entry per group holding its ring bytes."""
        out: dict[str, dict[str, dict[str, float]]] = {}
        for (kind, group), calls in sorted(self.calls.items()):
            key = (kind, group)
            out.setdefault(group, {})[kind] = {
                "calls": calls,
                "elements": self.elements[key],
                "bytes": self.bytes[key],
                "ring_bytes": self.ring_bytes[key],
            }
        for group, kinds in out.items():
            kinds["total"] = {"ring_bytes": sum(v["ring_bytes"] for v in kinds.values())}
        return out


_ACTIVE: list[CollectiveCounts] = []
_LOCK = threading.Lock()


@contextlib.contextmanager
def count_collectives() -> Iterator[CollectiveCounts]:
    """Count every collective this process issues inside the block."""
    counts = CollectiveCounts()
    with _LOCK:
        _ACTIVE.append(counts)
    try:
        yield counts
    finally:
        with _LOCK:
            _ACTIVE.remove(counts)


def record(kind: str, group: str, n: int, tensor: torch.Tensor, stats: CollectiveCounts | None = None) -> None:
    """Count one collective in every open :func:`count_collectives` block and in ``stats``.

    Thread-safe: the communication thread counts too (see :mod:`hybridshard.runtime.comm.executors.threads`).
    """
    with _LOCK:
        for counts in _ACTIVE if stats is None else [*_ACTIVE, stats]:
            counts.record(kind, group, n, tensor)
