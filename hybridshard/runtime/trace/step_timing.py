"""Per-rank step timing for the straggler report: compute time and each collective's time, no host sync.

[Note: step timing]
A step is the time between two forwards that start a new step (a ``no_sync`` micro-batch's forward
does not): the data loader's time is in it. What the training thread spends blocked on a collective
(``Pending.wait``, the thread executor's ``drain``) is *blocked* time; the rest is *compute* (the
model, the hooks' own work, the loader, the optimizer). Each collective is timed from its issue to
its completion: on CPU the host's clock at issue and at the first ``wait()``, which is the
completion when the work was still running then and an upper bound when it had already finished
(a gloo future callback would be exact but costs ~40 us per collective: more than the budget).
On CUDA two timing events bracket it on the stream it is issued on (the start completes when that
stream reached the collective, the end when the kernel finished), and the compute stream's stalls
on the executor's fences are bracketed the same way; compute is the step's span on the compute
stream minus those stalls. Events are read a step late with ``query()``, never ``synchronize()``:
the host never waits for the device here (the emulated device counts no sync). Under
``executor="emulate"`` a collective is timed when its stream runs it.

A collective's time is the wait for the last peer to arrive plus the transfer. Neither can be
separated on one rank without a common clock; across the members of one group it can: they all
finish together, so the member that arrived last waited least, its time is the transfer, and each
member's excess over it is its wait (:mod:`hybridshard.runtime.faults.verdicts`).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CLOCK", "StepClock", "StepTimes", "TimedOp", "enabled"]

_ON: list[bool] = []
"""Non-empty while a clock runs: the one check the collectives make when it is off."""


def enabled() -> bool:
    return bool(_ON)


@dataclass(frozen=True)
class StepTimes:
    """One step of one rank, in seconds."""

    step: int
    step_s: float
    compute_s: float
    """The step minus the time the training thread (CUDA: the compute stream) was blocked on a collective."""
    comm_s: dict[str, float] = field(default_factory=dict)
    """``"kind@group"`` -> the step's collectives of that kind on that group, issue to completion, summed."""


class TimedOp:
    """One collective being timed: host clocks (CPU) or two events (CUDA)."""

    __slots__ = ("key", "issued", "done", "start", "end")

    def __init__(self, key: str, start: Any) -> None:
        self.key, self.issued, self.done, self.start, self.end = key, time.perf_counter(), None, start, None

    def waited(self, started: float, was_done: bool) -> None:
        """The host's first wait on it began at ``started``; ``was_done``: it had already completed."""
        if self.done is None and self.start is None:
            self.done = started if was_done else time.perf_counter()

    def seconds(self) -> float | None:
        """Issue to completion; ``None`` while unknown (a CUDA event not reached yet)."""
        if self.start is not None:
            if self.end is None or not self.end.query():
                return None
            return self.start.elapsed_time(self.end) / 1e3
        return None if self.done is None else self.done - self.issued


class _Step:
    __slots__ = ("step", "started", "blocked", "ops", "event", "stalls")

    def __init__(self, step: int, event: Any) -> None:
        self.step, self.started, self.blocked, self.ops, self.event = step, time.perf_counter(), 0.0, [], event
        self.stalls: list[tuple[Any, Any]] = []


class StepClock:
    """This process's step timing; see [Note: step timing]."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: int | None = None
        self._step: _Step | None = None
        self._late: deque[tuple[_Step, float, Any]] = deque()
        """CUDA: closed steps whose events are read once they completed (a step late)."""
        self.finished: deque[StepTimes] = deque(maxlen=4096)
        self._cuda: torch.device | None = None
        self._compute_stream: Any = None
        self.members: dict[str, tuple[int, ...]] = {}
        """Group name -> the global ranks of this rank's group of that name."""

    def start(self) -> None:
        _ON[:] = [True]

    def running(self) -> bool:
        return bool(_ON)

    def stop(self) -> None:
        _ON.clear()
        self._step = None
        self._late.clear()

    # -- the step ------------------------------------------------------------------------------------

    def at_forward(self, step: int, device: torch.device | None = None) -> None:
        """A forward starts at ``step`` (syncing backwards so far): a new step closes the previous one."""
        current = self._step
        if current is not None and current.step == step:
            return  # a no_sync micro-batch's forward, or another model's root
        event = None
        if device is not None and device.type == "cuda":
            self._cuda, self._compute_stream = device, torch.cuda.current_stream(device)
            event = torch.cuda.Event(enable_timing=True)
            event.record(self._compute_stream)
        self._thread = threading.get_ident()
        new = _Step(step, event)
        with self._lock:
            self._step = new
        if current is not None:
            self._close(current, new.started, event)
        self._read_late()

    def _close(self, step: _Step, ended: float, end_event: Any) -> None:
        if step.event is None:
            self._emit(step, ended - step.started, None)
        else:
            self._late.append((step, ended, end_event))

    def _read_late(self) -> None:
        while self._late:
            step, _, end_event = self._late[0]
            if not end_event.query():
                return
            self._late.popleft()
            span = step.event.elapsed_time(end_event) / 1e3
            self._emit(step, span, sum(_elapsed(a, b) for a, b in step.stalls))

    def _emit(self, step: _Step, step_s: float, stalled: float | None) -> None:
        comm: dict[str, float] = {}
        for op in step.ops:
            seconds = op.seconds()
            if seconds is not None:
                comm[op.key] = comm.get(op.key, 0.0) + seconds
        blocked = step.blocked if stalled is None else stalled
        self.finished.append(StepTimes(step.step, step_s, max(step_s - blocked, 0.0), comm))

    # -- what the collectives and executors tell it --------------------------------------------------

    def issued(self, kind: str, name: str, group: Any, tensor: torch.Tensor) -> TimedOp | None:
        """A collective is about to be issued on the current stream; its record (``None``: no step yet)."""
        step = self._step
        if step is None:
            return None
        if name not in self.members:
            try:
                self.members[name] = tuple(dist.get_process_group_ranks(group))
            except (RuntimeError, ValueError, AttributeError):  # a group torch does not know (torchft's)
                self.members[name] = ()
        start = None
        if tensor.is_cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        op = TimedOp(f"{kind}@{name}", start)
        with self._lock:
            step.ops.append(op)
        return op

    def blocked(self, started: float) -> None:
        """The calling thread was blocked on a collective since ``started``: counted if it trains."""
        step = self._step
        if step is not None and threading.get_ident() == self._thread:
            step.blocked += time.perf_counter() - started

    def stall_begins(self, stream: Any) -> Any:
        """CUDA: ``stream`` is about to wait on a fence; an event before it when it is the compute stream."""
        step = self._step
        if step is None or step.event is None or stream != self._compute_stream:
            return None
        before = torch.cuda.Event(enable_timing=True)
        before.record(stream)
        return before

    def stall_ends(self, before: Any, stream: Any) -> None:
        step = self._step
        if before is None or step is None:
            return
        after = torch.cuda.Event(enable_timing=True)
        after.record(stream)
        step.stalls.append((before, after))

    def take(self) -> list[StepTimes]:
        """The steps finished since the last call, oldest first."""
        out = []
        while self.finished:
            out.append(self.finished.popleft())
        return out


def _elapsed(a: Any, b: Any) -> float:
    return a.elapsed_time(b) / 1e3 if b.query() else 0.0


def end_op(op: TimedOp | None) -> None:
    """CUDA: the current stream waited for the collective; an event marks its end."""
    if op is not None and op.start is not None and op.end is None:
        op.end = torch.cuda.Event(enable_timing=True)
        op.end.record()


CLOCK = StepClock()
"""The process's clock (one training thread per process; the scale harness's rank threads run none)."""
