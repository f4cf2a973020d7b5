"""Host-device syncs made by the runtime, counted per step and phase on the emulated device.

[Note: counting host syncs]
On a GPU each of these makes the host wait until the device has run everything queued before it,
which drains the queue the host had run ahead by: ``.item()``, ``.tolist()``, ``.cpu()`` or a copy
into host memory without ``non_blocking``, ``torch.tensor(<host data>, device=...)`` and an event's or
stream's ``synchronize()``. On the emulated device (see [Note: emulated device] in
:mod:`hybridshard.runtime.comm.executors.emulate`) the first emulated runtime wraps these calls once per process,
and every call made from hybridshard's own code is counted under ``(step, phase, site)``; calls
from elsewhere (the user's ``loss.item()``) are not the runtime's business. Some syncs are known
and counted apart, as exempt: ``clip_grad_norm_``'s one (it returns a Python float),
``GradScaler.step``'s ``found_inf.item()`` (torch's own, to decide whether to step), with CPU
offload the one event sync after the gradients' copies to host memory (the optimizer steps on the
CPU; see [Note: CPU offload]), and fault-tolerant mode's two, which torchft makes: ``should_commit``
(on a GPU it synchronizes the device, then a round trip to the manager; one a step) and the wait for
its gloo all-reduce of each unit's gradient shard at the end of backward (gloo's ``wait()`` blocks
the host until its thread ran the all-reduce, which waited for the all-reduce stream; one per unit
a step; see [Note: managed replicate all-reduce] in :mod:`hybridshard.ft.replicate`). Those two are
counted by name where hybridshard calls into torchft (:data:`EXEMPT_SITES`), not by module, so any
other sync in ``hybridshard.ft`` is a hot one. Everything else is a sync in the hot path: the
emulator test matrix requires none from the second step on.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
from typing import Any, Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from hybridshard.runtime.trace.position import current_where

logger = logging.getLogger(__name__)

__all__ = ["EXEMPT", "EXEMPT_SITES", "HostCopy", "SyncCounts", "count_here", "counts", "install", "mark_host",
           "to_device"]

EXEMPT = {
    "hybridshard.runtime.optim.grad_norm": "clip_grad_norm_",
    "torch.amp.grad_scaler": "GradScaler.step found_inf",
    "hybridshard.runtime.units.offload": "CPU offload: gradients arrived",
}
"""Calling module -> what the documented exempt sync is."""

EXEMPT_SITES = ("torchft should_commit", "torchft all-reduce wait")
"""Exempt syncs counted by name (:func:`count_here` with ``exempt=``) rather than by calling module:
fault-tolerant mode's, which torchft makes on a GPU and which its modules do not make on the
emulated device (see [Note: counting host syncs]). Any other sync in ``hybridshard.ft`` is a hot one."""


class SyncCounts:
    """Host syncs per ``(step, phase, site)``, split into hot-path and exempt ones."""

    def __init__(self) -> None:
        self.hot: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self.exempt: collections.Counter[tuple[int, str, str]] = collections.Counter()
        self._lock = threading.Lock()

    def reset(self) -> None:
        with self._lock:
            self.hot.clear()
            self.exempt.clear()

    def count(self, kind: str, module: str, function: str, exempt: str | None = None) -> None:
        w = current_where()
        exempt = exempt if exempt is not None else EXEMPT.get(module)
        key = (w.step, w.phase, f"{kind} in {module}.{function}" if exempt is None else exempt)
        with self._lock:
            (self.exempt if exempt is not None else self.hot)[key] += 1

    def steady(self, from_step: int = 1) -> dict[tuple[int, str, str], int]:
        """Hot-path syncs counted from step ``from_step`` on (steps count from 0)."""
        return {k: v for k, v in self.hot.items() if k[0] >= from_step}


_COUNTS = SyncCounts()
_INSTALLED: list[Any] = []
_ORIGINALS: list[tuple[Any, str, Any]] = []
_INHERITED = object()  # the name came from a base class: uninstall deletes the wrapper
_HOST: dict[int, StorageWeakRef] = {}
"""Storages that are host memory on a real device (pinned copies, offloaded masters), while counting."""


def mark_host(tensor: torch.Tensor) -> torch.Tensor:
    """Say that ``tensor`` is host memory (reading it is no sync); only recorded while counting."""
    if _INSTALLED:
        storage = tensor.untyped_storage()
        if len(_HOST) > 256:
            for key in [k for k, ref in _HOST.items() if ref.expired()]:
                del _HOST[key]
        _HOST[storage._cdata] = StorageWeakRef(storage)
    return tensor


def _is_host(tensor: Any) -> bool:
    if not _HOST or not isinstance(tensor, torch.Tensor):
        return False
    ref = _HOST.get(tensor.untyped_storage()._cdata)
    return ref is not None and not ref.expired()


def to_device(values: list[int], device: torch.device) -> torch.Tensor:
    """A small int64 tensor of host ``values`` on ``device`` with no host sync: from pinned memory,
    non-blocking, on CUDA (``torch.tensor(values, device=cuda)`` copies from pageable memory and waits)."""
    host = torch.tensor(values, dtype=torch.int64)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host if device.type == "cpu" else host.to(device)


class HostCopy:
    """A small device tensor on its way to host memory without making the host wait: on CUDA a
    non-blocking copy to pinned memory and an event after it; elsewhere the tensor itself."""

    __slots__ = ("host", "event")

    def __init__(self, tensor: torch.Tensor) -> None:
        if tensor.is_cuda:
            self.host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self.host.copy_(tensor, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = mark_host(tensor), None

    def ready(self) -> bool:
        """Whether the copy has arrived (asking costs no sync)."""
        return self.event is None or self.event.query()

    def tolist(self) -> list:
        """The values; waits for the copy only if it has not arrived (the device is that far behind)."""
        if not self.ready():
            self.event.synchronize()
        return self.host.tolist()


def counts() -> SyncCounts:
    return _COUNTS


def count_here(kind: str, *, exempt: str | None = None) -> None:
    """Count a sync the caller makes on the emulated device, where the call itself is none (an event
    it would synchronize on a GPU); nothing unless counting. ``exempt``: one of :data:`EXEMPT_SITES`,
    the documented exempt sync this is."""
    if exempt is not None and exempt not in EXEMPT_SITES:
        raise ValueError(f"{exempt!r} is not a documented exempt sync: {EXEMPT_SITES}")
    caller = _caller()
    if _INSTALLED and caller is not None:
        _COUNTS.count(kind, *caller, exempt=exempt)


def _caller() -> tuple[str, str] | None:
    """The module and function that called the wrapped method, if it is hybridshard's (or an exempt one)."""
    frame = sys._getframe(2)
    module = frame.f_globals.get("__name__", "")
    if module.startswith("hybridshard.") or module in EXEMPT:
        return module, frame.f_code.co_name
    return None


def _wrap(kind: str, original: Callable, is_sync: Callable[..., bool] = lambda *a, **k: True) -> Callable:
    @functools.wraps(original)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        caller = _caller()
        if caller is not None and (kind.startswith("copy_") or not (args and _is_host(args[0]))) \
                and is_sync(*args, **kwargs):
            _COUNTS.count(kind, *caller)
        return original(*args, **kwargs)

    return wrapper


def _copy_to_host(target: Any, source: Any, non_blocking: bool = False) -> bool:
    """``host.copy_(device_tensor)`` without ``non_blocking``: the host waits for the copy."""
    return not non_blocking and _is_host(target) and isinstance(source, torch.Tensor) and not _is_host(source)


def _from_host(data: Any, *args: Any, **kwargs: Any) -> bool:
    return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)


def install() -> SyncCounts:
    """Wrap the syncing calls once per process (the first emulated runtime does it); the counts."""
    if not _INSTALLED:
        T = torch.Tensor
        targets = [(T, n) for n in ("item", "tolist", "__bool__", "__int__", "__float__", "cpu", "copy_")]
        targets += [(torch, "tensor"), (torch.cuda.Event, "synchronize"), (torch.cuda.Stream, "synchronize")]
        _ORIGINALS.extend((owner, name, owner.__dict__.get(name, _INHERITED)) for owner, name in targets)
        for name in ("item", "tolist", "__bool__", "__int__", "__float__"):
            setattr(T, name, _wrap(name, getattr(T, name)))
        T.cpu = _wrap("cpu", T.cpu, lambda self, *a, **k: not k.get("non_blocking", False))
        T.copy_ = _wrap("copy_ to host memory", T.copy_, _copy_to_host)
        torch.tensor = _wrap("torch.tensor(host data, device=)", torch.tensor, _from_host)
        for cls in (torch.cuda.Event, torch.cuda.Stream):
            cls.synchronize = _wrap(f"{cls.__name__}.synchronize", cls.synchronize)
        _INSTALLED.append(True)
    return _COUNTS


def uninstall() -> None:
    """Put back what :func:`install` wrapped (a process that goes on without the emulated device)."""
    while _ORIGINALS:
        owner, name, original = _ORIGINALS.pop()
        if original is _INHERITED:
            delattr(owner, name)
        else:
            setattr(owner, name, original)
    _INSTALLED.clear()
