"""The executor seam: what the engine and the units ask of whoever issues a model's collectives.

Two implementations: :class:`~hybridshard.runtime.comm.executors.threads.ThreadExecutor` (a
communication thread, CPU/gloo) and :class:`~hybridshard.runtime.comm.executors.streams.StreamExecutor`
(CUDA streams, or the emulated device's); :mod:`~hybridshard.runtime.comm.executors.select` picks one.
"""

from __future__ import annotations

import enum
import logging
from typing import TYPE_CHECKING, Any, Callable, Protocol, runtime_checkable

import torch

from hybridshard.runtime.comm import collectives as C

if TYPE_CHECKING:
    from hybridshard.runtime.units.unit import Unit

logger = logging.getLogger(__name__)

__all__ = ["Executor", "ExecutorBase", "Finish", "JobState"]

Finish = Callable[[torch.Tensor], "tuple[torch.Tensor, C.Pending | None]"]
"""What is left of a unit's reduction once its first collective is done: shard -> (shard, still running)."""


class JobState(enum.Enum):
    """Where one unit's gradient job is, in either executor."""

    ISSUED = "issued"
    """The first collective is in flight."""
    SCATTERED = "scattered"
    """The first collective is done: the unsharded gradient may go."""
    REDUCED = "reduced"
    """The executor's part is done; ``shard`` holds the reduced gradient shard once ``wait`` returns."""
    FAILED = "failed"
    """A collective raised; ``error`` holds it."""


@runtime_checkable
class Executor(Protocol):
    """Issues a model's parameter gathers and gradient reductions."""

    kind: str
    """``"threads"`` or ``"streams"`` (the emulated device runs the stream executor)."""
    copy_stream: Any
    """Where offloaded shards are copied to the device ahead of their gathers (CUDA only), else ``None``."""

    def __bool__(self) -> bool:
        """Whether gradient jobs are in flight."""

    def gather(self, output: torch.Tensor, make_input: Callable[[], torch.Tensor], group: Any, *,
               stats: Any = None, async_op: bool = False, after: Any = None) -> C.Pending | None:
        """All-gather every rank's ``make_input()`` into ``output`` once ``after`` (if any) is done."""

    def submit(self, unit: Unit, full: torch.Tensor, shard: torch.Tensor,
               issue_first: Callable[[], C.Pending | None], finish: Finish) -> None:
        """Issue a unit's first gradient collective and run ``finish`` once it is done."""

    def drain(self) -> list[tuple[Unit, torch.Tensor]]:
        """Wait for every job in submission order: ``(unit, reduced shard)`` each; raises the first failure
        once every job ended."""

    def end_step(self) -> None:
        """Called as a step's forward begins."""

    def abort(self) -> None:
        """After a backward that raised: let the jobs end and drop their results."""


class ExecutorBase:
    """What both executors share: ``abort`` on top of their ``drain``."""

    copy_stream: Any = None

    def drain(self) -> list[tuple[Unit, torch.Tensor]]:
        raise NotImplementedError

    def end_step(self) -> None:
        """Nothing by default (the emulated device runs what it still queues)."""

    def abort(self) -> None:
        try:
            self.drain()
        except Exception:  # noqa: BLE001 - the backward's own error is the one that matters
            logger.warning("a gradient reduction of the aborted backward failed too", exc_info=True)
