"""The asynchronous gradient path: reduce each unit's gradient while backward goes on.

[Note: overlapped gradient reduction]
A unit's post-backward hook hands its unsharded gradient to :class:`ThreadExecutor` and returns, so
autograd moves on to the next unit's backward while the gradient travels:

* the hook's (main) thread issues the shard-group reduce-scatter at once, asynchronously, so every
  shard-group collective (prefetching all-gathers included) is issued in the same order on every rank;
* for a hybrid unit, the rest (scale by 1/world, add what ``no_sync`` held, the replicate
  all-reduce, compressed or not) runs on one communication thread per process, in submission order;
  during a backward only it touches replicate groups, so their order is the same everywhere too,
  and the inter-node all-reduce overlaps the next units' backward compute;
* a non-hybrid unit's one collective (world reduce-scatter, or NO_SHARD's all-reduce) is issued by
  the hook too (the world may be another unit's shard group); the thread waits for it and scales.

:meth:`ThreadExecutor.drain` (end-of-backward callback) waits for every job in submission order and
only then adds each reduced shard to ``.grad`` on the main thread: the arithmetic and its order are
the synchronous path's, bitwise. A job drops its unsharded gradient once its reduce-scatter is done,
and the next unit's hook waits for that reduce-scatter before issuing its own: at most two unsharded
gradients are alive however far the thread lags. For CPU tensors on gloo only (``wait()`` blocks the
host); with NCCL its replicate all-reduces would race the hooks' collectives to the device, so CUDA
uses [Note: stream executor] (:mod:`hybridshard.runtime.comm.executors.streams`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable

import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm import two_hop
from hybridshard.runtime.comm.executors.base import ExecutorBase, Finish, JobState
from hybridshard.runtime.trace import hook_clock, position, step_timing

if TYPE_CHECKING:
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["GradJob", "ThreadExecutor"]

class GradJob:
    """One unit's gradient between its post-backward hook and ``.grad``."""

    def __init__(self, unit: Unit, full: torch.Tensor, shard: torch.Tensor, first: C.Pending,
                 finish: Finish) -> None:
        self.unit = unit
        self._where = position.snapshot()
        self.full = full
        """The unsharded gradient: the reduce-scatter reads it until it completes."""
        self.shard = shard
        self._first = first
        self._finish = finish
        self._last: C.Pending | None = None
        self.state = JobState.ISSUED
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._scattered = threading.Event()

    def run(self) -> None:
        """On the communication thread: wait for the first collective, then do the rest."""
        with hook_clock.thread_job("GradJob.run (thread)"):  # see [Note: one hook clock]
            self._run()

    def _run(self) -> None:
        if self.state is not JobState.ISSUED:
            return
        try:
            with position.working_for(self._where):
                self._first.wait()
                self._first = None  # and with it the receive buffer
                self.full = None  # the reduce-scatter no longer reads it: free it now, not at the next submit
                self.state = JobState.SCATTERED
                self._scattered.set()
                self.shard, self._last = self._finish(self.shard)
            self.state = JobState.REDUCED
        except BaseException as err:  # noqa: BLE001 - handed to the main thread by wait()
            self.error = err
            self.state = JobState.FAILED
        finally:
            self._scattered.set()
            self._done.set()

    def release_full(self) -> None:
        """Drop the unsharded gradient once the first collective no longer reads it (waits for that)."""
        if self.full is not None:
            self._scattered.wait()
            self.full = None

    def wait(self) -> torch.Tensor:
        if step_timing.enabled() and not self._done.is_set():
            started = time.perf_counter()
            self._done.wait()
            step_timing.CLOCK.blocked(started)  # the training thread waits for the communication thread
        self._done.wait()
        if self.error is not None:
            raise self.error
        if self._last is not None:
            last, self._last = self._last, None
            last.wait()
        return self.shard


class _Worker:
    """The process's communication thread: runs queued jobs one at a time, in order."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[GradJob] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="hybridshard-comm", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            self._queue.get().run()

    def put(self, job: GradJob) -> None:
        self._queue.put(job)


_WORKER: _Worker | None = None
_WORKER_LOCK = threading.Lock()


def _worker() -> _Worker:
    global _WORKER
    with _WORKER_LOCK:
        if _WORKER is None:
            _WORKER = _Worker()
        return _WORKER


class ThreadExecutor(ExecutorBase):
    """The jobs of one backward, in submission order; see [Note: overlapped gradient reduction].

    The thread executor, for CPU tensors on gloo; CUDA uses the stream executor (see
    [Note: stream executor] in :mod:`hybridshard.runtime.comm.executors.streams`).
    """

    kind = "threads"

    def __init__(self) -> None:
        self._jobs: list[GradJob] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def gather(self, output: torch.Tensor, make_input: Callable[[], torch.Tensor], group: Any, *,
               stats: Any = None, async_op: bool = False, after: Any = None) -> C.Pending | None:
        """All-gather every rank's ``make_input()`` into ``output``, from the calling (main) thread,
        once ``after`` (if any) is done."""
        if after is not None:
            after.wait()
        # A multi-node shard group's inner hops wait for the unit's wait: [Note: a deferred inner hop]
        return two_hop.gather(output, make_input(), group, stats=stats, async_op=async_op, defer=True)

    def submit(self, unit: Unit, full: torch.Tensor, shard: torch.Tensor,
               issue_first: Callable[[], C.Pending | None], finish: Finish) -> None:
        """Issue a unit's first collective (``issue_first()``, from the calling thread) and hand the
        rest to the communication thread.

        The thread waits for that collective, drops ``full`` and runs ``finish``, whose collectives
        must be on groups that only the thread uses during backward (the replicate groups). ``finish``
        returns the shard and, if it left one running, its last collective, which :meth:`drain` waits for.
        """
        for earlier in self._jobs:
            # At most one unsharded gradient in flight besides this one: the previous unit's
            # reduce-scatter had this unit's whole backward to finish. The thread drops it once
            # scattered; if it has not got there yet, it is waited for and dropped here, before
            # this one's buffers exist.
            earlier.release_full()
        first = issue_first() or C.DONE
        job = GradJob(unit, full, shard, first, finish)
        self._jobs.append(job)
        _worker().put(job)

    def drain(self) -> list[tuple[Unit, torch.Tensor]]:
        """Wait for every job in order; ``(unit, reduced shard)`` for each. Raises the first failure
        after every job ended, so no collective is left running."""
        jobs, self._jobs = self._jobs, []
        out, error = [], None
        for job in jobs:
            try:
                out.append((job.unit, job.wait()))
            except BaseException as err:  # noqa: BLE001 - re-raised below
                error = error or err
        if error is not None:
            raise error
        return out

