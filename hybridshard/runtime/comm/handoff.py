"""Tensors handed to a backend's own threads, released only once the backend let go of them.

[Note: tensors handed to a backend thread]
An asynchronous collective keeps its tensors in a C++ work object that a backend thread runs
(gloo's ``ProcessGroupGloo::runLoop``). That thread marks the work finished - ``wait()`` returns on
the Python side - and only then drops its reference to the work. If Python has dropped its own
references to a tensor by then (a temporary receive buffer, say), the C++ tensor outlives its Python
object, so PyTorch keeps that object alive and lets the C++ side own it: the backend thread's drop
then destroys the tensor and must take the GIL to release the Python object.

During a run that only costs the thread a wait for the GIL. When the process is ending it is fatal:
once the interpreter finalizes, CPython ends any other thread that asks for the GIL with
``pthread_exit``, whose unwinding crosses the work's ``noexcept`` destructor, and the C++ runtime
calls ``std::terminate``: the rank dies with SIGABRT and ``terminate called without an active
exception`` after printing its results, and torchrun reports the finished job as failed. A core
dump of such a rank shows exactly this: the main thread in ``Py_FinalizeEx``'s garbage collection, a
gloo worker in ``~AsyncAlltoallWork -> TensorImpl::decref_pyobject -> take_gil ->
PyThread_exit_thread -> std::terminate`` (the all-to-all of the last reduce-scatter, whose receive
buffer is a temporary).

So no tensor the runtime owns is ever handed to a backend: :func:`hand_off` gives the backend a
fresh alias (``detach()``: same storage, its own C++ tensor, no autograd link) and keeps only a
*weak* reference to it. The runtime's own tensors then never change hands, and the alias's Python
object lives exactly as long as the backend holds the alias: once the backend let go, it is
released, on whichever thread held the last reference (a backend thread that must take the GIL for
it does so while the interpreter still runs). Memory is what it would be without aliases: an alias
shares its storage, so a buffer freed with ``resize_(0)`` is freed as before, and a temporary is
freed when the backend drops it. :func:`settle`, registered with ``atexit`` and so run before the
interpreter finalizes, sleeps (releasing the GIL, boundedly) until every alias is gone: no backend
thread is then left needing the GIL for one.

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

__all__ = ["hand_off", "held", "release", "settle", "sweep"]

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
