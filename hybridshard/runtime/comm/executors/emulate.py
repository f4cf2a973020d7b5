"""The emulated device: CUDA streams and NCCL's rules on CPU tensors, made as hostile as they may be.

[Note: emulated device]
On CPU the stream executor's streams are no-ops and a gloo collective keeps its tensors alive and
runs before ``wait()`` returns, so a buffer freed while a side stream still reads it, or a wait in
the wrong place, never shows. ``executor="emulate"`` (or ``HYBRIDSHARD_EXECUTOR=emulate``) runs the
stream executor over :class:`EmulatedStreams`: each side stream is a queue (torch ops caught below
autograd by a dispatch mode, collectives by :mod:`hybridshard.runtime.comm.collectives`) that runs
as late as events allow; a collective's ``wait()`` returns at once and drops the backend's
references (NCCL since torch 2.7); every buffer a queued operation touches is held and, when it
runs, checked by identity (never by value): one freed, regrown, or referenced only by the emulator
was released too early, and the step fails with :class:`DeviceFault` naming the unit, the buffer
and the stream (buffers allocated on the same stream are exempt). The full model, what it proves
and what it cannot: docs/runtime.md ("The emulated device").
"""

from __future__ import annotations

import collections
import contextlib
import logging
from typing import Any, Callable, Iterator

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.comm.executors.streams import Fence, StreamSet, host_blocking
from hybridshard.runtime.comm.handoff import hand_off
from hybridshard.runtime.trace import host_syncs
from hybridshard.runtime.trace.position import current_where

logger = logging.getLogger(__name__)

__all__ = ["DeviceFault", "EmuEvent", "EmuStream", "EmulatedStreams", "label"]

_USE_COUNT = torch._C._storage_Use_Count
_aten = torch.ops.aten
_FACTORIES = {_aten.empty.memory_format, _aten.empty_like.default, _aten.empty_strided.default,
              _aten.new_empty.default, _aten.new_empty_strided.default}
_HOST_READS = {_aten._local_scalar_dense.default, _aten.equal.default, _aten.is_nonzero.default}
_LABELS: dict[int, tuple[int, str]] = {}
"""Per storage: its data pointer and a name the runtime gave it (:func:`label`), while emulating."""
_LIVE: list[bool] = []
"""Non-empty once a device is emulated in this process (labels are kept from then on)."""


class DeviceFault(RuntimeError):
    """The emulated device found an operation that would be undefined on a GPU."""


def label(tensor: torch.Tensor, name: str) -> None:
    """Name ``tensor``'s buffer in the emulator's messages; nothing unless a device is emulated."""
    if _LIVE:
        storage = tensor.untyped_storage()
        _LABELS[storage._cdata] = (storage.data_ptr(), name)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


def _set_versions(tensors: list[torch.Tensor], versions: list[int]) -> None:
    if tensors:
        _SET_VERSIONS(tuple(tensors), tuple(versions))


_SET_VERSIONS = torch._C._autograd._unsafe_set_version_counter


class _Op:
    """One queued operation: ``run`` holds only emulator aliases (``holds``) of the tensors it touches.

    Version counters move when the work is *issued*, as they do on a GPU (the host bumps them): the
    ``written`` tensors are bumped now, and whatever running the work later bumps is undone, so the
    runtime's checks of changed parameters see what they would see on a device.
    """

    __slots__ = ("what", "run", "holds", "where", "stream")

    def __init__(self, what: str, run: Callable[[], None], holds: list[torch.Tensor], stream: "EmuStream",
                 written: list[torch.Tensor] = ()) -> None:
        w = current_where()
        self.what, self.run, self.stream = what, run, stream
        self.where = (w.unit, w.phase)
        _set_versions(list(written), [t._version + 1 for t in written])
        # (alias, storage key, data pointer, bytes): what the buffer was when the work was queued
        unique = list({id(t): t for t in holds}.values())  # each alias holds its storage once
        self.holds = [(t, _key(t), t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in unique]


class EmuStream:
    """A side stream: a queue of operations, run in order as late as the events on it allow."""

    def __init__(self, device: "EmulatedStreams", name: str) -> None:
        self.device, self.name = device, name
        self.queue: collections.deque[_Op] = collections.deque()
        self.enqueued = 0
        """Operations queued so far (an event records this count)."""
        self.ran = 0
        self.unwaited: list[tuple[int, Any]] = []
        """``(position, issue_order.Issue)`` of recorded collectives no stream has waited on yet."""

    def enqueue(self, op: _Op) -> None:
        self.device.hold(op)
        self.queue.append(op)
        self.enqueued += 1

    def run_until(self, count: int) -> None:
        """Run the queued operations up to the ``count``-th (an event's position)."""
        while self.ran < count:
            op = self.queue.popleft()
            self.ran += 1
            self.device.execute(op)

    def __repr__(self) -> str:
        return f"<emulated {self.name} stream>"


class EmuEvent:
    """An event recorded on an emulated stream after its ``count``-th operation."""

    __slots__ = ("stream", "count")

    def __init__(self, stream: EmuStream) -> None:
        self.stream, self.count = stream, stream.enqueued

    def wait_here(self) -> None:
        """The current stream waits for it: the host runs the stream up to it now, a side stream
        queues a marker that does so when it runs."""
        device = self.stream.device
        waiter = device.current
        if self.stream is waiter:
            return
        device.note_wait(self, waiter)
        covered = [issue for position, issue in self.stream.unwaited if position < self.count]
        if covered:
            unit = current_where().unit
            name = device.unit_names[unit] if 0 <= unit < len(device.unit_names) else f"#{unit}"
            for issue in covered:
                issue.waited_by.append(f"{'compute' if waiter is None else waiter.name} in unit {name}")
            self.stream.unwaited = [(p, i) for p, i in self.stream.unwaited if p >= self.count]
        if waiter is None:
            self.stream.run_until(self.count)
        else:
            stream, count = self.stream, self.count
            waiter.enqueue(_Op(f"wait for the {stream.name} stream", lambda: stream.run_until(count), [], waiter))


class _EmuPending:
    """A collective queued on an emulated stream: ``wait()`` returns at once and drops the backend's
    references (NCCL); the work itself runs when the stream does."""

    __slots__ = ("_backend",)

    def __init__(self, tensors: tuple[torch.Tensor, ...]) -> None:
        self._backend: tuple[torch.Tensor, ...] | None = tuple(t.detach() for t in tensors)

    def is_completed(self) -> bool:
        return self._backend is None

    def wait(self) -> None:
        self._backend = None


class _EmuBlocking:
    """A collective queued by :meth:`EmulatedStreams.defer_blocking`: ``wait()`` runs its stream up to it
    (on a GPU gloo's thread waits for that stream, the host for gloo), then waits the backend's work."""

    __slots__ = ("_stream", "_count", "_result")

    def __init__(self, stream: EmuStream, count: int, result: list[Any]) -> None:
        self._stream, self._count, self._result = stream, count, result

    def wait(self) -> Any:
        self._stream.run_until(self._count)
        return self._result[0].wait()


class EmulatedStreams(StreamSet):
    """The stream executor's streams on the emulated device; see [Note: emulated device]."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.on_cuda = False
        self.all_gather = EmuStream(self, "all_gather")
        self.reduce_scatter = EmuStream(self, "reduce_scatter")
        self.all_reduce = EmuStream(self, "all_reduce")
        self.copy = None  # offloaded shards are staged on the host (see docs/runtime.md: limits)
        self.current: EmuStream | None = None
        """The side stream the host is issuing to, or ``None`` for the compute stream."""
        self.executing = False
        self.unit_names: list[str] = []
        """Set by the runtime once its units exist, to name them in faults."""
        self._held: collections.Counter[int] = collections.Counter()
        self._storages: dict[int, Any] = {}
        self._allocated_on: dict[int, tuple[StorageWeakRef, str]] = {}
        """Per storage allocated while a side stream was current: that stream (weakly held)."""
        self.waits: list[tuple[str, str, int, str]] = []
        """``(stream waited on, waiting stream, unit, phase)`` per wait this step (``"compute"``: the host)."""
        self.syncs = host_syncs.install()
        _LIVE[:] = [True]

    # -- issuing -----------------------------------------------------------------------------------

    @contextlib.contextmanager
    def side(self, stream: Any, *, after: Fence | None = None, follow_compute: bool = True) -> Iterator[None]:
        # Compute work already ran (host order), so following the compute stream costs nothing here.
        previous, self.current = self.current, stream
        C.EMULATED.append(self)
        try:
            with _Capture(self):
                if after is not None:
                    after.wait()
                yield
        finally:
            C.EMULATED.pop()
            self.current = previous

    def fence(self, stream: Any, pending: Any) -> Fence:
        pending = pending if pending is not None else C.DONE
        later = host_blocking(pending)
        if later is None:
            pending.wait()
        return Fence(event=EmuEvent(stream), pending=later)

    def defer_collective(self, what: str, run: Callable[[], None], touched: tuple[torch.Tensor, ...],
                         written: tuple[torch.Tensor, ...], issue: Any = None) -> _EmuPending:
        """Queue a collective on the current side stream (called by :mod:`hybridshard.runtime.comm.collectives`)."""
        stream = self.current
        assert stream is not None
        for t in touched:
            if t.device.type != self.device.type:
                raise DeviceFault(
                    f"{what} on the {stream.name} stream expects tensors on {self.device}, found one on {t.device}; "
                    "NCCL rejects host tensors: allocate it on the compute device"
                )
        if issue is not None:
            stream.unwaited.append((stream.enqueued, issue))
        stream.enqueue(_Op(what, run, list(touched), stream, list(written)))
        return _EmuPending(touched)

    def defer_blocking(self, what: str, issue: Callable[[torch.Tensor], Any], tensor: torch.Tensor) -> _EmuBlocking:
        """Queue ``issue(tensor)`` (it returns a backend's work) on the current side stream: a collective
        whose ``wait()`` blocks the host (torchft's gloo all-reduce, see [Note: managed replicate
        all-reduce] in :mod:`hybridshard.ft.replicate`), held and checked like the others."""
        stream, result = self.current, []
        (alias,) = hand_off(tensor)
        self.defer_collective(what, lambda: result.append(issue(alias)), (alias,), (alias,))
        return _EmuBlocking(stream, stream.enqueued, result)

    def note_wait(self, event: EmuEvent, waiter: EmuStream | None) -> None:
        unit, phase = current_where().unit, current_where().phase
        self.waits.append((event.stream.name, "compute" if waiter is None else waiter.name, unit, phase))

    # -- running -----------------------------------------------------------------------------------

    def hold(self, op: _Op) -> None:
        for alias, key, _, _ in op.holds:
            self._held[key] += 1
            self._storages.setdefault(key, alias.untyped_storage())

    def execute(self, op: _Op) -> None:
        try:
            for alias, key, ptr, nbytes in op.holds:
                self._check(op, alias, key, ptr, nbytes)
            aliases = [alias for alias, _, _, _ in op.holds]
            versions = [alias._version for alias in aliases]
            self.executing = True
            try:
                op.run()
            finally:
                self.executing = False
                _set_versions(aliases, versions)  # bumped when issued (see _Op)
        finally:
            for _, key, _, _ in op.holds:
                self._held[key] -= 1
                if not self._held[key]:
                    del self._held[key]
                    self._storages.pop(key, None)
            op.holds = []

    def _check(self, op: _Op, alias: torch.Tensor, key: int, ptr: int, nbytes: int) -> None:
        uses = _USE_COUNT(key)  # before any storage object of its own is made here
        storage = alias.untyped_storage()
        if storage.nbytes() != nbytes or storage.data_ptr() != ptr:
            why = "its storage was freed" + (" and allocated again" if storage.nbytes() else "")
        elif self._allocated_by(key) == op.stream.name:
            return  # allocated on this stream: reused only in its order
        elif uses <= self._held[key] + 1:  # + 1: the storage object the emulator keeps
            why = "the runtime dropped its last reference to it"
        else:
            return
        unit, phase = op.where
        name = self.unit_names[unit] if 0 <= unit < len(self.unit_names) else f"#{unit}"
        raise DeviceFault(
            f"emulated device: {op.what} queued on the {op.stream.name} stream (unit {name!r}, {phase}) touches "
            f"{self._describe(key, alias)} after {why}; keep that buffer referenced until the stream that frees "
            f"it has waited on an event recorded after this {op.stream.name}-stream work\n"
            "On a GPU the caching allocator may give that memory to another tensor while the stream still reads "
            "or writes it (see [Note: emulated device] in hybridshard/runtime/comm/executors/emulate.py)."
        )

    def _describe(self, key: int, alias: torch.Tensor) -> str:
        storage = alias.untyped_storage()
        ptr, name = _LABELS.get(key, (None, ""))
        what = f"buffer {name!r}" if name and ptr == storage.data_ptr() else "a buffer"
        stream = self._allocated_by(key) or "compute"
        return f"{what} ({alias.dtype}, {storage.nbytes()} bytes, storage {key:#x}, allocated on the {stream} stream)"

    def _allocated_by(self, key: int) -> str | None:
        ref, stream = self._allocated_on.get(key, (None, None))
        return None if ref is None or ref.expired() else stream

    def mark_allocated(self, outputs: Any, stream: EmuStream) -> None:
        for t in tree_flatten(outputs)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                self._allocated_on[storage._cdata] = (StorageWeakRef(storage), stream.name)

    def end_step(self) -> None:
        """Run everything queued (the end of a step), then forget the step's allocations and waits."""
        assert self.current is None, "end_step inside a side stream"
        for stream in (self.all_gather, self.reduce_scatter, self.all_reduce):
            stream.run_until(stream.enqueued)
        for stream in (self.all_gather, self.reduce_scatter, self.all_reduce):  # markers may queue none; twice is enough
            stream.run_until(stream.enqueued)
        self._allocated_on = {k: v for k, v in self._allocated_on.items() if not v[0].expired()}
        self.waits.clear()
        _LABELS.clear()

    def pending(self) -> int:
        return sum(len(s.queue) for s in (self.all_gather, self.reduce_scatter, self.all_reduce))


def _alias_of_return(func: Any, args: tuple, kwargs: dict) -> Any:
    """For an op that writes some of its arguments and returns them: those arguments, as it returns them."""
    schema = func._schema
    named = {a.name: a for a in schema.arguments}
    values = {a.name: (args[i] if i < len(args) else kwargs.get(a.name)) for i, a in enumerate(schema.arguments)}
    out = []
    for ret in schema.returns:
        found = next(n for n, a in named.items() if a.alias_info is not None and ret.alias_info is not None
                     and a.alias_info.before_set == ret.alias_info.before_set)
        out.append(values[found])
    return out[0] if len(out) == 1 else tuple(out)


class _Capture(TorchDispatchMode):
    """Queues the torch ops issued while a side stream is current; see [Note: emulated device]."""

    def __init__(self, device: EmulatedStreams) -> None:
        super().__init__()
        self.device = device

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        device, stream = self.device, self.device.current
        if stream is None or device.executing:
            return func(*args, **kwargs)
        returns = func._schema.returns
        if func in _HOST_READS:  # the host waits for this stream, then reads
            stream.run_until(stream.enqueued)
            return func(*args, **kwargs)
        if returns and all(r.alias_info is not None and not r.alias_info.is_write for r in returns):
            return func(*args, **kwargs)  # a view: metadata only, made at once
        if func in _FACTORIES:
            out = func(*args, **kwargs)
            device.mark_allocated(out, stream)
            return out
        flat, spec = tree_flatten((args, kwargs))
        aliases = [a.detach() if isinstance(a, torch.Tensor) else a for a in flat]
        holds = [a for a in aliases if isinstance(a, torch.Tensor)]
        if not holds and not any("Tensor" in str(r.type) for r in returns):
            return func(*args, **kwargs)  # host bookkeeping (torchft's profiler ranges): no tensor, nothing to wait for
        if returns and all(r.alias_info is not None and r.alias_info.is_write for r in returns):
            def run_in_place() -> None:
                a, k = tree_unflatten(aliases, spec)
                func(*a, **k)
            result = _alias_of_return(func, args, kwargs)
            written = [t for t in tree_flatten(result)[0] if isinstance(t, torch.Tensor)]
            stream.enqueue(_Op(f"{func.__name__}", run_in_place, holds, stream, written))
            return result
        try:
            meta = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except (NotImplementedError, RuntimeError):
            meta = None
        outs = tree_flatten(meta)[0]
        if meta is None or not outs or not all(isinstance(m, torch.Tensor) for m in outs):
            stream.run_until(stream.enqueued)  # no meta kernel: run it now, after what is queued
            return func(*args, **kwargs)
        real = [torch.empty_strided(m.shape, m.stride(), dtype=m.dtype, device=device.device) for m in outs]
        device.mark_allocated(real, stream)
        targets = [r.detach() for r in real]

        def run_functional() -> None:
            a, k = tree_unflatten(aliases, spec)
            for target, value in zip(targets, tree_flatten(func(*a, **k))[0]):
                target.copy_(value)
        stream.enqueue(_Op(f"{func.__name__}", run_functional, holds + targets, stream))
        return tree_unflatten(real, tree_flatten(meta)[1])


def _to_meta(x: Any) -> Any:
    return x.to("meta") if isinstance(x, torch.Tensor) else x
