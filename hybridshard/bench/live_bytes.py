"""Count the bytes of tensor storages that a piece of code allocates and keeps alive, over time.

    with LiveTensorBytes() as live:
        out = f()
    live.peak(exclude=live.storages_of(out))     # peak bytes of what f allocated, not counting out

[Note: counting live tensor bytes]
``tracemalloc`` does not see tensor storages and the CPU allocator keeps no peak, so this is a
``TorchDispatchMode``: every op's output tensor whose storage is none of the op's inputs' storages
is a new allocation (``empty``, ``clone``, ``_to_copy``...), recorded with its storage's size; a
view or an in-place result shares an input's storage and only adds a reference to it. A
``weakref.finalize`` on every tensor that refers to a storage tells when the last one dies, so the
storage is counted from its allocation to that moment. Storages that existed before the mode, and
views of them, are never counted. What it cannot see: memory a backend allocates inside one op
(gloo's all-gather may stage through a buffer of its own), and a storage that C++ keeps alive after
its last Python tensor is gone; so the figure is what the Python-level code allocates and holds.

An in-place op returns its input object, which adds no reference: otherwise an object that was
never counted (an ``nn.Parameter`` made around a counted tensor) would pin the storage until the
object dies, even after its ``.data`` moved elsewhere (deferred init points parameters at shards).

Memory that no op allocates (a storage grown with ``untyped_storage().resize_()``) can be entered
by hand into the same timeline with :meth:`LiveTensorBytes.record`, or every storage resize at once
with :meth:`LiveTensorBytes.counting_resizes`; every storage carries a label
(the op that allocated it, or the one given), and :meth:`LiveTensorBytes.alive_at_peak` says what
was alive at the peak. The mode is thread-local: ops on another thread are not seen.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


def _key(t: torch.Tensor) -> int:
    """The storage's identity: its C++ object, which a ``resize_`` keeps (its data pointer moves)."""
    return t.untyped_storage()._cdata


def _has_storage(t: torch.Tensor) -> bool:
    """False for a wrapper subclass (a DTensor): its memory is that of the plain tensors it holds,
    which the ops it dispatches to are counted through."""
    return not (type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter
                and getattr(t, "__torch_dispatch__", None) is not torch.Tensor.__torch_dispatch__)


class LiveTensorBytes(TorchDispatchMode):
    """See [Note: counting live tensor bytes]."""

    def __init__(self) -> None:
        super().__init__()
        self._ids: dict[int, int] = {}  # live storage -> its id
        self._refs: dict[int, int] = {}  # id -> live tensors referring to it
        self._resized: dict[int, int] = {}  # a storage first seen in a resize -> its id
        self._released: dict[int, int] = {}  # a storage whose counted tensors all died -> its id
        self.sizes: dict[int, int] = {}  # id -> bytes counted now (its allocation, then its resizes)
        self.events: list[tuple[int, int]] = []  # (id, +bytes allocated or grown | -bytes released or shrunk), in order
        self.labels: dict[int, str] = {}  # id -> the op that allocated it, or record()'s label

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - the mode protocol
        kwargs = kwargs or {}
        if func is torch.ops.aten.resize_.default:  # a tensor's resize_ grows its storage in place
            storage = args[0].untyped_storage()
            before = storage.nbytes()
            out = func(*args, **kwargs)
            self._resize(storage, storage.nbytes() - before)
            return out
        out = func(*args, **kwargs)
        leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and _has_storage(t)]
        inputs = {_key(t) for t in leaves}
        for t in tree_leaves(out):
            if any(t is a for a in leaves):
                continue  # an in-place result is its input: no new reference (see the note)
            if isinstance(t, torch.Tensor) and _has_storage(t) and t.device.type != "meta" and t.untyped_storage().nbytes():
                self._track(t, inputs, str(func))
        return out

    def _track(self, t: torch.Tensor, inputs: set[int], label: str = "") -> None:
        key = _key(t)
        sid = self._ids.get(key)
        if sid is None:
            if key in inputs:
                return  # a view of, or a write into, a storage from before the mode
            sid = len(self.sizes)
            self._ids[key] = sid
            self._released.pop(key, None)
            self.sizes[sid] = t.untyped_storage().nbytes()
            self._refs[sid] = 0
            self.labels[sid] = label
            self.events.append((sid, self.sizes[sid]))
        self._refs[sid] += 1
        weakref.finalize(t, self._release, sid, key)

    def _release(self, sid: int, key: int) -> None:
        self._refs[sid] -= 1
        if self._refs[sid] == 0:
            self.events.append((sid, -self.sizes[sid]))
            if self._ids.get(key) == sid:
                del self._ids[key]
                self._released[key] = sid

    def record(self, label: str, nbytes: int) -> int:
        """Enter an allocation of ``nbytes`` that no op made (e.g. a ``resize_``); its id, for :meth:`release`."""
        sid = len(self.sizes)
        self.sizes[sid] = nbytes
        self.labels[sid] = label
        self.events.append((sid, nbytes))
        return sid

    def release(self, sid: int) -> None:
        """End an allocation entered with :meth:`record`."""
        self.events.append((sid, -self.sizes[sid]))

    @contextlib.contextmanager
    def counting_resizes(self) -> Iterator["LiveTensorBytes"]:
        """Inside the block, every ``UntypedStorage.resize_`` (on any thread) enters its change in size.

        Flat-parameter runtimes (hybridshard, FSDP1, FSDP2) free and regrow their unsharded buffers
        this way, which no op reports. A change is entered under the storage's own id (a storage from
        before the mode gets one at its first resize), so a storage an op allocated, freed with
        ``resize_(0)`` and then dropped is not released twice, and ``alive_at_peak`` sees what it holds.
        """
        original = torch.UntypedStorage.resize_

        def resize_(storage, size):  # noqa: ANN001 - the method's own signature
            before = storage.nbytes()
            out = original(storage, size)
            self._resize(storage, storage.nbytes() - before)
            return out

        torch.UntypedStorage.resize_ = resize_
        try:
            yield self
        finally:
            torch.UntypedStorage.resize_ = original

    def _resize(self, storage: torch.UntypedStorage, change: int) -> None:
        """Enter ``storage``'s change in size under its own id (see :meth:`counting_resizes`)."""
        if not change or storage.device.type == "meta":
            return
        key = storage._cdata
        sid = self._ids.get(key, self._resized.get(key))
        if sid is None and key in self._released:
            # [Note: a storage outliving its tensors] It was alive after all (held by a tensor whose
            # ``.data`` it became, which no op reports): counted again from here, under its id.
            sid = self._resized[key] = self._released.pop(key)
            self.events.append((sid, self.sizes[sid]))
        if sid is None:
            sid = self._resized[key] = len(self.sizes)
            self.sizes[sid] = 0
            self.labels[sid] = "resize_"
        self.sizes[sid] += change
        self.events.append((sid, change))

    def storages_of(self, tensors: Iterable[Any]) -> set[int]:
        """Ids of the counted storages under ``tensors`` (e.g. a function's outputs)."""
        return {self._ids[_key(t)] for t in tree_leaves(list(tensors))
                if isinstance(t, torch.Tensor) and _key(t) in self._ids}

    def peak(self, exclude: set[int] = frozenset()) -> int:
        """The most bytes alive at once, leaving out the storages ``exclude``."""
        live = peak = 0
        for sid, change in self.events:
            if sid not in exclude:
                live += change
                peak = max(peak, live)
        return peak

    def alive_at_peak(self, exclude: set[int] = frozenset()) -> dict[int, tuple[str, int]]:
        """``{id: (label, bytes)}`` of the storages alive at the (first) peak."""
        alive: dict[int, int] = {}
        best: dict[int, int] = {}
        live = peak = 0
        for sid, change in self.events:
            if sid in exclude:
                continue
            live += change
            alive[sid] = alive.get(sid, 0) + change
            if alive[sid] == 0:
                del alive[sid]
            if live > peak:
                peak, best = live, dict(alive)
        return {sid: (self.labels.get(sid, ""), n) for sid, n in best.items()}

    def live(self) -> int:
        """Bytes counted and still alive."""
        return sum(change for _, change in self.events)
