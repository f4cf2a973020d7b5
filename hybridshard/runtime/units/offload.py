"""``CPUOffload``: sharded parameters, their gradients and the optimizer state kept in CPU memory.

[Note: CPU offload]
With ``shard(..., offload=hs.CPUOffload())`` each unit's master shard lives in CPU memory (pinned
when CUDA is present, so copies to the GPU run asynchronously), and so do the parameters (views of
it), their ``.grad`` and so the optimizer's state: ``optimizer.step()`` runs on the CPU.

* gather: when unit ``k`` starts, the prefetcher issues the all-gathers of ``k+1 .. k+prefetch`` and
  *stages* the next unit's shard (:func:`stage`: copied to the GPU and cast, on the copy stream),
  which the all-gather stream waits for by event; the staged buffer is recorded on that stream so
  the allocator does not hand it out before the all-gather read it. A staged copy is used only if
  the master's version counters did not change since ([Note: stale gathers]); a stale or unused one
  is dropped at the end of the pass (it only reads the master). With no staged copy the copy runs
  right before the all-gather, on its stream.
* reduction: unchanged on the GPU; each reduced shard is copied into pinned host memory without
  blocking, in unit order, on the compute stream. At the end of backward the host waits once, on an
  event after the last copy (:func:`arrived`), then adds them into the flat gradient shards: the
  optimizer never reads a gradient still on its way. One sync a step, the documented exempt sync of
  offload ([Note: counting host syncs] in :mod:`hybridshard.runtime.trace.host_syncs`).

On a CPU device the master already lives in CPU memory: offloading changes only when the
all-gather's input is made (cast when staged), which the CPU tests check, version check included.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from hybridshard.runtime.trace import host_syncs

logger = logging.getLogger(__name__)

__all__ = ["CPUOffload", "Staged", "arrived", "parse_offload", "place_master", "stage"]


@dataclass(frozen=True)
class CPUOffload:
    """Keep sharded parameters, gradients and optimizer state in CPU memory; see [Note: CPU offload]."""

    pin_memory: bool = True
    """Pin the master shards (page-locked), so copies to the GPU run asynchronously. Ignored without CUDA."""

    def __post_init__(self) -> None:
        if not isinstance(self.pin_memory, bool):
            raise ValueError(f"CPUOffload.pin_memory must be True or False; got {self.pin_memory!r}")


def parse_offload(value: object) -> CPUOffload | None:
    """``None``/``False`` -> no offload; ``True`` -> ``CPUOffload()``; a ``CPUOffload`` -> itself."""
    if value is None or value is False:
        return None
    if value is True:
        return CPUOffload()
    if isinstance(value, CPUOffload):
        return value
    raise ValueError(f"offload must be a hybridshard.CPUOffload, True, False or None; got {value!r}. "
                     "Pass offload=hybridshard.CPUOffload() to keep the sharded state in CPU memory")


def place_master(shard: torch.Tensor, offload: CPUOffload | None) -> torch.Tensor:
    """``shard`` moved to where the master lives (a new tensor, pinned when asked and CUDA is present)."""
    if offload is None:
        return shard.clone()
    out = shard.to("cpu", copy=True)
    if offload.pin_memory and torch.cuda.is_available():
        out = out.pin_memory()
    return out


@dataclass
class Staged:
    """A unit's all-gather input made ahead of its gather; see [Note: CPU offload]."""

    tensor: torch.Tensor
    event: Any
    """The copy stream's event after the copy (``None`` on CPU: made synchronously)."""
    versions: tuple[int, ...]
    """The master's version counters when it was made."""

    def take(self, versions: tuple[int, ...], device: torch.device) -> torch.Tensor | None:
        """The staged input for use on the current stream, or ``None`` if the master changed since."""
        if versions != self.versions:
            return None
        if self.event is not None:
            current = torch.cuda.current_stream(device)
            current.wait_event(self.event)
            self.tensor.record_stream(current)  # made on the copy stream, read on this one
        return self.tensor


def stage(make: Callable[[], torch.Tensor], versions: tuple[int, ...], stream: Any) -> Staged:
    """Run ``make`` (the all-gather input: the master copied to the device and cast) on ``stream``,
    the copy stream, or right here without one (CPU)."""
    if stream is None:
        return Staged(make(), None, versions)
    with torch.cuda.stream(stream):
        tensor = make()
        event = torch.cuda.Event()
        event.record(stream)
    return Staged(tensor, event, versions)


def arrived(device: torch.device) -> None:
    """The host waits once until every gradient copy to host memory queued on ``device`` has arrived: an
    event recorded after them, synchronized (counted as offload's exempt sync on the emulated device)."""
    if device.type == "cuda":
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(device))
        event.synchronize()
    else:
        host_syncs.count_here("Event.synchronize")
