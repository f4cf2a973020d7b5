"""``CPUOffload``: sharded parameters, their gradients and the optimizer state kept in CPU memory.

[Note: CPU offload]
With ``shard(..., offload=hs.CPUOffload())`` each unit's master shard lives in CPU memory (pinned
when CUDA is present, so copies to the GPU run asynchronously), and so do the original parameters
(views of it), their ``.grad`` and therefore the optimizer's state: ``optimizer.step()`` runs on the
CPU. Only gathered buffers and the gradients in flight use the GPU. The steps change like this:

* gather: the shard is copied to the GPU (and cast to the compute dtype) right before its
  all-gather, on the same side stream (the all-gather stream of [Note: stream executor] in
  :mod:`hybridshard.runtime.streams`). A prefetch issues both ahead, so the copy of the next units'
  shards runs while the current unit computes; the copy's buffer is used only on that stream;
* reduction: unchanged on the GPU; at the end of backward each reduced shard is copied to the CPU
  into the flat gradient shard the parameters' ``.grad`` view. That copy waits for the device, so
  every copy out of the master shard has finished before the optimizer steps it on the CPU.

On a CPU device the master is already in CPU memory: offloading changes nothing (and costs nothing),
which is what the CPU tests check.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

__all__ = ["CPUOffload", "master_device", "parse_offload", "place_master"]


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


def master_device(offload: CPUOffload | None, device: torch.device) -> torch.device:
    """Where the master shards live: the CPU when offloading, else the compute device."""
    return torch.device("cpu") if offload is not None else device


def place_master(shard: torch.Tensor, offload: CPUOffload | None) -> torch.Tensor:
    """``shard`` moved to where the master lives (a new tensor, pinned when asked and CUDA is present)."""
    if offload is None:
        return shard.clone()
    out = shard.to("cpu", copy=True)
    if offload.pin_memory and torch.cuda.is_available():
        out = out.pin_memory()
    return out
