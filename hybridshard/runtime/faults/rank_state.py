"""One rank's control-plane state: its store, its collectives in flight, its watchdog thread, its
heartbeat and what it published.

[Note: one control plane per rank]
A process is one rank, and uses one :class:`ControlPlane`, the process default that
:func:`current` returns. The scale harness (``benchmarks/control_plane_scale.py``) runs thousands
of ranks as threads of one process: each rank's threads are bound to that rank's own plane
(:func:`bound`), so :mod:`~hybridshard.runtime.faults.peers`, :mod:`~hybridshard.runtime.faults.watchdog` and
:mod:`~hybridshard.runtime.faults.exits` run their real code per rank, each with its own store client.
The process-wide hooks (``sys.excepthook``, ``atexit``) stay one per process.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator

__all__ = ["ControlPlane", "bound", "current"]


class ControlPlane:
    """The control-plane state of one rank (see [Note: one control plane per rank])."""

    def __init__(self, store: Any = None, rank: int | None = None, world: int | None = None) -> None:
        self.found: dict[str, Any] = {}
        """``store`` and ``identity`` once found (given here by the scale harness)."""
        self.explicit = store is not None
        """The store and identity were given: no process group is consulted."""
        if store is not None:
            self.found = {"store": store, "identity": (int(rank or 0), int(world or 1))}
        self.lock = threading.Lock()
        self.in_flight: dict[int, Any] = {}
        """Token -> :class:`~hybridshard.runtime.faults.watchdog.InFlight`."""
        self.ids = itertools.count()
        self.thread: threading.Thread | None = None
        self.stop = threading.Event()
        """Set to stop the watchdog thread (the harness also sets it to kill a simulated rank)."""
        self.beats = 0
        """Heartbeats written so far (see [Note: heartbeats] in :mod:`hybridshard.runtime.faults.peers`)."""
        self.last_beat = 0.0
        self.final: dict[str, Any] | None = None
        """What this rank published last (raised, failed, done): its heartbeat says only that from then on."""
        self.causes_polled = float("-inf")
        """When the watchdog last read the count of causes (see [Note: keeping the causes] in
        :mod:`hybridshard.runtime.faults.causes`)."""
        self.causes: dict[str, Any] = {}
        """The causes this rank kept and its place in the store's list of them, for one store
        (:func:`hybridshard.runtime.faults.causes.state`)."""
        self.override: dict[str, Any] | None = None
        """This rank's own answer while it asks (a failed collective, its exit)."""
        self.raised = False
        """An uncaught exception was published: no "finished" check at exit."""
        self.on_stop: Callable[[int], None] | None = None
        """Called instead of ending the process (the harness records the rank's report)."""
        self.is_ready: Callable[[], bool] | None = None
        """Whether the job is up (default: the default process group exists)."""
        self.watch_main = True
        """Whether the mismatch check watches the process's main thread. The harness's ranks have no
        main thread of their own, and looking at it costs O(threads): thousands of ranks as threads of
        one process would spend a core on it (see [Note: entry point on some ranks only] in
        :mod:`hybridshard.runtime.faults.mismatch`)."""


_DEFAULT = ControlPlane()
_LOCAL = threading.local()


def current() -> ControlPlane:
    """The calling thread's rank's plane: the one it was bound to, else the process default."""
    return getattr(_LOCAL, "plane", None) or _DEFAULT


@contextlib.contextmanager
def bound(plane: ControlPlane) -> Iterator[ControlPlane]:
    """Run the block (in the calling thread) as the rank of ``plane``."""
    outer = getattr(_LOCAL, "plane", None)
    _LOCAL.plane = plane
    try:
        yield plane
    finally:
        _LOCAL.plane = outer
