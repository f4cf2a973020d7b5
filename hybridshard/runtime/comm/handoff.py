"""Tensors handed to a backend's own threads, released only once the backend let go of them.

[Note: tensors handed to a backend thread]
A backend thread (gloo's) drops its reference to a finished collective's work after ``wait()``
returned; if that drop destroys the last reference to a tensor, the thread must take the GIL, which
kills the rank while the interpreter finalizes (docs/runtime.md, "A finished job exits 0"). So no
tensor the runtime owns is handed to a backend: :func:`hand_off` gives it a ``detach()`` alias (same
storage, so memory is freed as before) and keeps only a weak reference to the alias, which is
released on whichever thread holds it last. :func:`settle`, registered with ``atexit``, sleeps
(boundedly, releasing the GIL) until every alias is gone.

Collectives outside the runtime (the user's own, ``all_gather_object``'s temporaries inside
torch.distributed) are not covered; their temporaries are dropped long before a rank exits unless
the very last thing a script does is such a call.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref

import torch

logger = logging.getLogger(__name__)

__all__ = ["hand_off", "settle", "sweep"]

_LOCK = threading.Lock()
_HANDED: list[weakref.ref] = []


def hand_off(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Aliases of ``tensors`` to give a backend instead of the tensors themselves; watched until it let go."""
    aliases = tuple(t.detach() for t in tensors)
    with _LOCK:
        _sweep_locked()
        _HANDED.extend(weakref.ref(a) for a in aliases)
    return aliases


def _sweep_locked() -> None:
    if _HANDED:
        _HANDED[:] = [r for r in _HANDED if r() is not None]


def sweep() -> int:
    """Forget the aliases already released; returns how many are still alive (held by a backend)."""
    with _LOCK:
        _sweep_locked()
        return len(_HANDED)


def settle(seconds: float = 3.0) -> bool:
    """Wait until every alias was released; ``False`` if some were not within ``seconds``.

    Sleeping lets a backend thread that waits for the GIL (to release an alias) finish first. A
    collective still running when a process exits (a rank leaving mid-job) never finishes; its
    aliases stay, and the wait ends at the bound.
    """
    deadline = time.monotonic() + seconds
    delay = 0.0005
    while sweep():
        if time.monotonic() >= deadline:
            logger.debug("%d tensors still held by a backend at exit", sweep())
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return True


atexit.register(settle)  # registered at import, so it runs after the runtime's own exit handlers
