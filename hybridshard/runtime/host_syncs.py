"""Host-device syncs made by the runtime, counted per step and phase on the emulated device.

[Note: counting host syncs]
On a GPU each of these makes the host wait until the device has run everything queued before it,
which drains the queue the host had run ahead by: ``.item()``, ``.tolist()``, ``.cpu()`` or
``.to(<host>)`` without ``non_blocking``, ``torch.tensor(<host data>, device=...)`` and an event's or
stream's ``synchronize()``. On the emulated device (see [Note: emulated device] in
:mod:`hybridshard.runtime.emulate`) the first emulated runtime wraps these calls once per process,
and every call made from hybridshard's own code is counted under ``(step, phase, site)``; calls
from elsewhere (the user's ``loss.item()``) are not the runtime's business. Three syncs are known
and counted apart, as exempt: ``clip_grad_norm_``'s one (it returns a Python float),
``GradScaler.step``'s ``found_inf.item()`` (torch's own, to decide whether to step) and torchft's
``should_commit`` round trip. Everything else is a sync in the hot path: the emulator test matrix
requires none from the second step on.
"""

from __future__ import annotations

import collections
import functools
import logging
import sys
import threading
from typing import Any, Callable

import torch

from hybridshard.runtime.position import current_where

logger = logging.getLogger(__name__)

__all__ = ["EXEMPT", "SyncCounts", "counts", "install"]

EXEMPT = {
    "hybridshard.runtime.grad_norm": "clip_grad_norm_",
    "torch.amp.grad_scaler": "GradScaler.step found_inf",
    "hybridshard.ft.mode": "torchft should_commit",
}
"""Calling module -> what the documented exempt sync is."""


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

    def count(self, kind: str, module: str, function: str) -> None:
        w = current_where()
        exempt = EXEMPT.get(module)
        key = (w.step, w.phase, f"{kind} in {module}.{function}" if exempt is None else exempt)
        with self._lock:
            (self.exempt if exempt is not None else self.hot)[key] += 1

    def steady(self, from_step: int = 1) -> dict[tuple[int, str, str], int]:
        """Hot-path syncs counted from step ``from_step`` on (steps count from 0)."""
        return {k: v for k, v in self.hot.items() if k[0] >= from_step}


_COUNTS = SyncCounts()
_INSTALLED: list[Any] = []


def counts() -> SyncCounts:
    return _COUNTS


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
        if caller is not None and is_sync(*args, **kwargs):
            _COUNTS.count(kind, *caller)
        return original(*args, **kwargs)

    return wrapper


def _to_host(tensor: Any, *args: Any, **kwargs: Any) -> bool:
    if kwargs.get("non_blocking") or (len(args) > 1 and args[1] is True and not isinstance(args[0], torch.dtype)):
        return False
    target = kwargs.get("device", args[0] if args and isinstance(args[0], (str, torch.device)) else None)
    return target is not None and torch.device(target).type == "cpu"


def _from_host(data: Any, *args: Any, **kwargs: Any) -> bool:
    return kwargs.get("device") is not None and not isinstance(data, torch.Tensor)


def install() -> SyncCounts:
    """Wrap the syncing calls once per process (the first emulated runtime does it); the counts."""
    if not _INSTALLED:
        T = torch.Tensor
        for name in ("item", "tolist"):
            setattr(T, name, _wrap(name, getattr(T, name)))
        T.cpu = _wrap("cpu", T.cpu, lambda self, *a, **k: not k.get("non_blocking", False))
        T.to = _wrap("to(host)", T.to, _to_host)
        torch.tensor = _wrap("torch.tensor(host data, device=)", torch.tensor, _from_host)
        for cls in (torch.cuda.Event, torch.cuda.Stream):
            cls.synchronize = _wrap(f"{cls.__name__}.synchronize", cls.synchronize)
        _INSTALLED.append(True)
    return _COUNTS
