"""The replicate reduction of fault-tolerant mode: each gradient shard averaged over the live replicas.

[Note: managed replicate all-reduce]
In fault-tolerant mode every replica group is its own torch.distributed job, so the runtime sees a
replicate group of one rank: its reduce-scatter divides by the shard-group size only. The shard then
goes to torchft's ``Manager.allreduce``, which sums it over the current quorum's replica groups
(shard rank ``j`` of each, one communicator per shard rank) and divides by the participants: the
mean over the *live* replicas, the gradient of the effective batch (docs/fault-tolerance.md). A
healing replica takes part with zeros and is not counted. A peer lost mid-collective does not raise
here: ``should_commit`` answers False on every replica of the step, so the optimizer does not step
on a corrupt gradient, and the next quorum leaves the lost peer out.

It is issued by whichever thread reduces the replicate shards, in unit order ([Note: one issue
order per communicator]). torchft's group is gloo, whose ``wait()`` blocks the host even for CUDA
tensors, so the pending all-reduce is ``host_blocking``: the stream executor waits for it at the end
of backward (``Fence.wait`` in :mod:`hybridshard.runtime.comm.executors.streams`), not inside the
backward. The quorum ``Manager.allreduce`` waits for is awaited at the end of the forward
(:meth:`ManagedReplicate.quorum_ready`), so inside backward that wait returns at once. That
end-of-backward wait is one of fault-tolerant mode's two exempt host syncs. On the emulated device
the all-reduce is queued on the all-reduce stream (``EmulatedStreams.defer_blocking``) and the
shard stays the runtime's until it has run.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.trace import host_syncs
from hybridshard.runtime.trace.counters import CollectiveCounts, record
from hybridshard.runtime.trace.step_timing import CLOCK

logger = logging.getLogger(__name__)

__all__ = ["GROUP_NAME", "ManagedReplicate"]

GROUP_NAME = "replicate"
"""The group name the managed all-reduce is counted under in :func:`hybridshard.comm_stats`."""


def waited(call: Any) -> Any:
    """``call()``, its time counted as blocked in the straggler report's step timing: torchft's quorum and
    all-reduce waits are waits for the other replica groups, not this group's compute (a healthy group
    beside a slow one would read as slow itself)."""
    started = time.perf_counter()
    try:
        return call()
    finally:
        CLOCK.blocked(started)


class _ManagedPending:
    """A managed all-reduce in flight; ``wait`` leaves the averaged shard in place (or, after a
    peer failure, whatever the manager left there: ``should_commit`` then answers False)."""

    __slots__ = ("_work",)
    host_blocking = True
    """gloo's ``wait()`` blocks the host: see [Note: managed replicate all-reduce]."""

    def __init__(self, work: Any) -> None:
        self._work = work

    def is_completed(self) -> bool:
        return self._work is None

    def wait(self) -> None:
        if self._work is not None:
            host_syncs.count_here("Work.wait", exempt="torchft all-reduce wait")  # see [Note: counting host syncs]
            work, self._work = self._work, None
            if waited(work.wait) is False:
                logger.warning("a replicate all-reduce failed; this step will not commit")


class ManagedReplicate:
    """The runtime's ``replicate_hook`` in fault-tolerant mode; see [Note: managed replicate all-reduce]."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.quorum_started = False
        """Set by ``FaultTolerance.start_step``: a quorum is being computed."""

    def quorum_ready(self, *_: Any) -> None:
        """At the end of a forward (a forward hook): wait for the step's quorum here, outside backward."""
        if self.quorum_started:
            self.quorum_started = False
            waited(self.manager.wait_quorum)

    def all_reduce(self, shard: torch.Tensor, *, stats: CollectiveCounts | None = None,
                   async_op: bool = False) -> _ManagedPending | None:
        emulated = C.EMULATED[-1] if C.EMULATED else None
        if emulated is not None:  # queued on the emulated all-reduce stream, run as late as it allows
            self.manager.wait_quorum()
            work = emulated.defer_blocking("all_reduce on torchft's replica groups", self.manager.allreduce, shard)
        else:
            work = waited(lambda: self.manager.allreduce(shard))  # waits for the step's quorum first
        record("all_reduce", GROUP_NAME, self.manager.num_participants(), shard, stats)
        pending = _ManagedPending(work)
        if async_op:
            return pending
        pending.wait()
        return None
