"""What one training step costs besides time: bytes per group and peak memory.

[Note: bench bytes]
hybridshard counts its own collectives (:func:`hybridshard.count_collectives`). FSDP1 and FSDP2 call
``torch.distributed.all_gather_single`` (FSDP1 on the CPU: ``all_gather`` into a list) /
``reduce_scatter_single`` / ``all_reduce`` (and the older ``*_into_tensor`` / ``*_tensor`` names) through the module, so while one of their steps runs, those
functions are wrapped to record each call into the same :class:`CollectiveCounts`, named by group
("shard", "replicate" by their ranks, else "world"/"other"). Both sides use the same ring model
(:func:`hybridshard.runtime.trace.counters.ring_bytes`): bytes one rank sends per step. Counting happens on one
untimed warm-up step only, so the wrappers never touch a timed step.

[Note: bench memory]
Peak memory of one step, the same way for every system: the bytes of the model state that lives
between steps (distinct storages of the parameters as the system keeps them, their gradients and
buffers, and the optimizer state) plus the highest point the step's own allocations reach above
where they started. On CUDA the latter is ``max_memory_allocated() - memory_allocated()`` around the
step. On the CPU, where the allocator keeps no statistics, it is the peak of live tensor bytes
(:class:`~hybridshard.bench.live_bytes.LiveTensorBytes`): every storage an op allocates is counted
until the last tensor referring to it dies, on whichever thread that happens, and every
``UntypedStorage.resize_`` (how all three systems free and regrow their unsharded buffers) enters
its change. The profiler's memory events used before saw frees on the profiling thread only, so a
buffer allocated by the hooks and dropped on hybridshard's communication thread (the all-to-all
receive buffers of overlapped reductions) counted as never freed. Neither method sees memory a
backend allocates inside one op (gloo's staging buffers), for any system. All systems live in one
process, so the process's RSS cannot tell them apart; it is reported once for the job.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import resource
from typing import Callable, Iterator

import torch
import torch.distributed as dist

from hybridshard.bench.live_bytes import LiveTensorBytes
from hybridshard.runtime.comm.collectives import CollectiveCounts

logger = logging.getLogger(__name__)

__all__ = ["count_torch_collectives", "peak_step_bytes", "state_bytes", "max_rss_bytes"]

# torch.distributed function -> (kind, name of the argument whose size counts). Only the
# ``torch.distributed`` namespace is wrapped: the deprecated names call the new ones inside
# ``distributed_c10d``, which stays untouched, so no call is counted twice.
_WRAPPED = {
    "all_gather_single": ("all_gather", "input_tensor"),
    "all_gather_into_tensor": ("all_gather", "input_tensor"),
    "reduce_scatter_single": ("reduce_scatter", "input"),
    "reduce_scatter_tensor": ("reduce_scatter", "input"),
    "all_gather": ("all_gather", "tensor"),  # FSDP1 gathers into a list of chunks on the CPU
    "all_reduce": ("all_reduce", "tensor"),
}


def _group_label(group, named: dict[tuple[int, ...], str]) -> str:
    if group is None or group is dist.group.WORLD:
        return "world"
    return named.get(tuple(dist.get_process_group_ranks(group)), "other")


@contextlib.contextmanager
def count_torch_collectives(groups) -> Iterator[CollectiveCounts]:
    """Record the ``torch.distributed`` collectives called inside the block; see [Note: bench bytes]."""
    counts = CollectiveCounts()
    named = {tuple(dist.get_process_group_ranks(g)): name
             for name, g in (("shard", groups.shard), ("replicate", groups.replicate))}
    originals = {}

    def wrap(fn: Callable, kind: str, tensor_arg: str) -> Callable:
        signature = inspect.signature(fn)

        def counted(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments
            group = bound.get("group")
            counts.record(kind, _group_label(group, named), dist.get_world_size(group), bound[tensor_arg])
            return fn(*args, **kwargs)

        return counted

    for name, (kind, tensor_arg) in _WRAPPED.items():
        fn = getattr(dist, name, None)
        if fn is not None:
            originals[name] = fn
            setattr(dist, name, wrap(fn, kind, tensor_arg))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def state_bytes(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind parameters, gradients, buffers and optimizer state."""
    seen: dict[tuple[str, int], int] = {}

    def add(t: torch.Tensor | None) -> None:
        if not isinstance(t, torch.Tensor):
            return
        storage = _local(t).untyped_storage()
        seen[(str(t.device), storage.data_ptr())] = storage.nbytes()

    for p in model.parameters():
        add(p)
        add(p.grad)
    for b in model.buffers():
        add(b)
    for state in optimizer.state.values():
        for value in state.values():
            add(value)
    return sum(n for (_, ptr), n in seen.items() if ptr)


def peak_step_bytes(step: Callable[[], object], device: torch.device) -> int:
    """How far this step's allocations rise above where they started; see [Note: bench memory]."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        step()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device) - before)
    live = LiveTensorBytes()
    with live, live.counting_resizes():
        step()
    return int(live.peak())


def max_rss_bytes() -> int:
    """This process's peak resident set (Linux reports kibibytes)."""
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024
