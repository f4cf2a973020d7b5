"""The stream executor: every collective issued by the thread running the hooks, overlap by CUDA streams.

[Note: stream executor]
NCCL runs a communicator's kernels in enqueue order ([Note: one issue order per communicator]), so
every collective of a unit is issued from the thread running its hooks, in the order the hooks run,
which every rank shares. Overlap comes from streams, not threads:

* an all-gather runs on the all-gather stream, after all the compute stream queued so far, straight
  into the unit's flat buffer; the unit's wait is the compute stream waiting on its event;
* a gradient's reduce-scatter (or NO_SHARD's all-reduce, the fp16 pre-divide) runs on the
  reduce-scatter stream, after the compute that produced the gradient;
* the rest (scale, what ``no_sync`` held, the replicate all-reduce) runs on the all-reduce stream,
  after the reduce-scatter's event: one unit's inter-node all-reduce overlaps the next one's
  intra-node collectives; at the end of backward the compute stream waits on every last event.

A side-stream collective is waited on its stream at once, and an event after it marks its end: a
:class:`Fence` (``host_blocking``, fault-tolerant mode's gloo all-reduce, is waited where its result
is needed). What a side stream reads or writes stays referenced until the compute stream waited on
an event covering it (the unsharded gradient until the next unit's post-backward hook: at most two
alive; shards, held gradients and compression inputs until the end of backward), and every buffer is
allocated on the stream that uses it, so freed memory is reused only in stream order. On CPU streams
are no-ops and a :class:`Fence` is the :class:`Pending`: ``executor="streams"`` tests the same rules.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING, Any, Callable, Iterator

import torch

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm import two_hop
from hybridshard.runtime.comm.executors.base import ExecutorBase, Finish, JobState
from hybridshard.runtime.trace import step_timing

if TYPE_CHECKING:
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["Fence", "StreamExecutor", "StreamSet", "host_blocking"]


class Fence:
    """The end of a collective issued on a side stream: a CUDA event, or on CPU the pending collective."""

    __slots__ = ("_event", "_pending", "_device")

    def __init__(self, *, event: Any = None, pending: C.Pending | None = None, device: Any = None) -> None:
        self._event, self._pending, self._device = event, pending, device

    def wait(self) -> None:
        """Make the calling stream wait for it (CUDA; the host goes on), or block until it is done (CPU).

        A collective whose ``wait()`` blocks the host even on CUDA (``host_blocking``: torchft's gloo
        work) was not waited when issued; it is waited here first, by whoever needs its result (the
        compute stream at the end of backward), never inside the all-reduce stream's job."""
        if self._event is not None and self._pending is not None:
            pending, self._pending = self._pending, None
            pending.wait()
        if self._event is not None and self._device is None:
            self._event.wait_here()  # the emulated device: see hybridshard/runtime/comm/executors/emulate.py
        elif self._event is not None:
            stream = torch.cuda.current_stream(self._device)
            if step_timing.enabled():  # the compute stream's stall, bracketed (see [Note: step timing])
                before = step_timing.CLOCK.stall_begins(stream)
                stream.wait_event(self._event)
                step_timing.CLOCK.stall_ends(before, stream)
            else:
                stream.wait_event(self._event)
        elif self._pending is not None:
            self._pending.wait()


def host_blocking(pending: Any) -> Any:
    """``pending`` if its ``wait()`` would block the host (see [Note: managed replicate all-reduce]
    in :mod:`hybridshard.ft.replicate`): it is then waited where its result is needed, not now."""
    return pending if getattr(pending, "host_blocking", False) else None


class StreamSet:
    """The side streams of one device ("all_gather", "reduce_scatter", "all_reduce", and "copy" for the
    host-to-device copies of offloaded shards); on CPU, none."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = device.type == "cuda"
        make = (lambda: torch.cuda.Stream(device, priority=-1)) if self.on_cuda else (lambda: None)
        # High priority: a collective's kernels should not queue behind the compute they overlap with.
        self.all_gather = make()
        self.reduce_scatter = make()
        self.all_reduce = make()
        self.copy = torch.cuda.Stream(device) if self.on_cuda else None

    @contextlib.contextmanager
    def side(self, stream: Any, *, after: Fence | None = None, follow_compute: bool = True) -> Iterator[None]:
        """Run the block with ``stream`` current. It first waits for what the compute stream queued
        (``follow_compute``) and for ``after``."""
        if stream is None:
            if after is not None:
                after.wait()
            yield
            return
        if follow_compute:
            stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            if after is not None:
                after.wait()
            yield

    def end_step(self) -> None:
        """A step begins: nothing to do on CUDA (the emulated device runs what it still queues)."""

    def fence(self, stream: Any, pending: C.Pending | None) -> Fence:
        """Inside ``side(stream)``, after issuing ``pending``: the fence that marks its end."""
        pending = pending if pending is not None else C.DONE
        if stream is None:
            return Fence(pending=pending)
        later = host_blocking(pending)
        if later is None:
            pending.wait()  # NCCL: the side stream waits for the collective; the host goes on
        event = torch.cuda.Event()
        event.record(stream)
        return Fence(event=event, pending=later, device=self.device)


class StreamJob:
    """One unit's gradient between its post-backward hook and the end of backward."""

    def __init__(self, unit: Unit, full: torch.Tensor, shard: torch.Tensor, finish: Finish,
                 scattered: Fence, done: Fence, read: torch.Tensor, first: Callable[[], Any]) -> None:
        self.unit = unit
        self.full = full
        """The unsharded gradient, read by the reduce-scatter until ``scattered``."""
        self.shard = shard
        self.read = read
        """The first collective's result, which ``finish`` reads on the all-reduce stream: kept until
        ``done`` (with the optimizer sharded across replicas ``shard`` is another buffer, and with a
        shard group of one this is a view of ``full``, which ``release_full`` lets go earlier)."""
        self.finish = finish
        """Kept for what it holds (a shard ``no_sync`` held, the compression's inputs) until ``done``."""
        self.first = first
        """The first collective's issuing function, kept for the same reason (NO_SHARD's adds what
        ``no_sync`` held on the reduce-scatter stream)."""
        self.scattered = scattered
        self.done = done
        self.state = JobState.ISSUED

    def release_full(self) -> None:
        """The compute stream waits for the reduce-scatter; then the unsharded gradient may go."""
        if self.full is not None:
            self.scattered.wait()
            # ``first`` closes over the unsharded gradient too: kept, it held every unit's until drain.
            self.full = self.first = None
            self.state = JobState.SCATTERED


class StreamExecutor(ExecutorBase):
    """Gathers and gradient reductions issued from the hooks' thread, overlapped by streams; see
    [Note: stream executor]. The same interface as :class:`~hybridshard.runtime.comm.executors.threads.ThreadExecutor`."""

    kind = "streams"

    def __init__(self, device: torch.device, streams: StreamSet | None = None) -> None:
        self.streams = StreamSet(device) if streams is None else streams
        self._jobs: list[StreamJob] = []

    def __bool__(self) -> bool:
        return bool(self._jobs)

    @property
    def copy_stream(self) -> Any:
        return self.streams.copy

    def gather(self, output: torch.Tensor, make_input: Callable[[], torch.Tensor], group: Any, *,
               stats: Any = None, async_op: bool = False, after: Any = None) -> Fence | None:
        """All-gather every rank's ``make_input()`` into ``output`` on the all-gather stream.

        ``make_input`` runs on that stream (a cast of the master shard stays off the compute stream),
        after ``after`` (the master's all-gather across replicas), which only that stream waits for.
        Without ``async_op`` the compute stream waits for it before returning.
        """
        s = self.streams
        with s.side(s.all_gather, after=after):
            fence = s.fence(s.all_gather, two_hop.gather(output, make_input(), group, stats=stats, async_op=True))
        if async_op:
            return fence
        fence.wait()
        return None

    def submit(self, unit: Unit, full: torch.Tensor, shard: torch.Tensor,
               issue_first: Callable[[], C.Pending | None], finish: Finish) -> None:
        """Issue a unit's gradient reduction now: ``issue_first()`` (its reduce-scatter, or
        NO_SHARD's all-reduce) on the reduce-scatter stream, then ``finish`` on the all-reduce stream."""
        for earlier in self._jobs:
            earlier.release_full()
        s = self.streams
        with s.side(s.reduce_scatter):
            scattered = s.fence(s.reduce_scatter, issue_first())
        with s.side(s.all_reduce, after=scattered, follow_compute=False):
            reduced, last = finish(shard)
            done = s.fence(s.all_reduce, last)
        self._jobs.append(StreamJob(unit, full, reduced, finish, scattered, done, read=shard, first=issue_first))

    def end_step(self) -> None:
        self.streams.end_step()

    def drain(self) -> list[tuple[Unit, torch.Tensor]]:
        """The compute stream waits for every job, in order; ``(unit, reduced shard)`` for each.
        Raises the first failure after every job was waited for."""
        jobs, self._jobs = self._jobs, []
        out, error = [], None
        for job in jobs:
            try:
                job.done.wait()
                job.state = JobState.REDUCED
                out.append((job.unit, job.shard))
            except BaseException as err:  # noqa: BLE001 - re-raised below
                job.state = JobState.FAILED
                error = error or err
            finally:
                job.full = job.finish = job.read = job.first = None
        if error is not None:
            raise error
        return out

