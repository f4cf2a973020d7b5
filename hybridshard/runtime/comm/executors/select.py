"""Which executor issues a model's collectives: the communication thread (CPU/gloo) or streams (CUDA).

``shard(..., executor=...)`` takes ``"auto"`` (the default), ``"threads"``, ``"streams"`` or
``"emulate"`` (the stream executor on the emulated device: see [Note: emulated device] in
:mod:`hybridshard.runtime.comm.executors.emulate`); with
``executor=None`` the ``HYBRIDSHARD_EXECUTOR`` environment variable decides, else ``"auto"``.
``"auto"`` picks the stream executor for a CUDA device and the thread executor otherwise. The
stream executor runs on CPU too, with its streams as no-ops: that is how its issuing rules are
checked without a GPU (see [Note: stream executor] in :mod:`hybridshard.runtime.comm.executors.streams`). The
thread executor is refused on CUDA: with NCCL its communication thread would enqueue replicate
all-reduces in an order that races the hooks' collectives (see [Note: one issue order per
communicator] in :mod:`hybridshard.runtime.trace.issue_order`).
"""

from __future__ import annotations

import enum
import logging
import os

import torch

from hybridshard.runtime.comm.executors.base import Executor
from hybridshard.runtime.comm.executors.emulate import EmulatedStreams
from hybridshard.runtime.comm.executors.streams import StreamExecutor
from hybridshard.runtime.comm.executors.threads import ThreadExecutor

logger = logging.getLogger(__name__)

__all__ = ["ENV", "ExecutorKind", "make_executor", "resolve_executor"]

ENV = "HYBRIDSHARD_EXECUTOR"


class ExecutorKind(enum.Enum):
    THREADS = "threads"
    """:class:`~hybridshard.runtime.comm.executors.threads.ThreadExecutor`: a communication thread (CPU tensors, gloo)."""
    STREAMS = "streams"
    """:class:`~hybridshard.runtime.comm.executors.streams.StreamExecutor`: one issuing thread, CUDA streams."""
    EMULATE = "emulate"
    """The stream executor on the emulated device (CPU tensors): queued side streams, NCCL's rules."""


_CHOICES = ("auto", "threads", "streams", "emulate")


def resolve_executor(requested: str | None, device: torch.device) -> ExecutorKind:
    """The executor for ``device``: ``requested``, else ``$HYBRIDSHARD_EXECUTOR``, else ``"auto"``."""
    source = "executor"
    if requested is None:
        requested, source = os.environ.get(ENV) or "auto", ENV
    if not isinstance(requested, str) or requested.lower() not in _CHOICES:
        raise ValueError(
            f"{source} must be one of {', '.join(map(repr, _CHOICES))}; got {requested!r}. Use 'auto' (streams on "
            "CUDA, the communication thread on CPU) unless checking the stream executor's issuing rules on CPU"
        )
    value = requested.lower()
    if value == "auto":
        return ExecutorKind.STREAMS if device.type == "cuda" else ExecutorKind.THREADS
    kind = ExecutorKind(value)
    if kind is ExecutorKind.THREADS and device.type == "cuda":
        raise ValueError(
            f"{source}='threads' runs on CPU tensors only, but the model is on {device}; use 'streams' or 'auto' "
            "(on CUDA the communication thread would enqueue NCCL collectives in an order that differs by rank)"
        )
    if kind is ExecutorKind.EMULATE and device.type != "cpu":
        raise ValueError(
            f"{source}='emulate' emulates a GPU with CPU tensors, but the model is on {device}; use 'streams' or "
            "'auto' on a real GPU, or device='cpu' to check the stream executor under the emulator"
        )
    return kind


def make_executor(kind: ExecutorKind, device: torch.device) -> Executor:
    if kind is ExecutorKind.EMULATE:
        return StreamExecutor(device, EmulatedStreams(device))
    return StreamExecutor(device) if kind is ExecutorKind.STREAMS else ThreadExecutor()
