"""Progress of a checkpoint save: the bytes each rank has written, logged at INFO as they go.

[Note: save progress]
DCP writes each rank's part as one file per writer thread (``__<rank>_<n>.distcp``) and reports
nothing until the whole save is done, so a save of many gigabytes looks like a hang.
:class:`ProgressWriter` is DCP's ``FileSystemWriter`` with a file system whose write streams count
the bytes that reach each file. Every rank logs ``rank R wrote X of Y (P%)`` when its count passes
another tenth of the tensor bytes it plans to write (at most once per :data:`PROGRESS_INTERVAL_S`),
and one line per finished file with its size. The planned total counts tensor chunks only: the
small pickled entries (optimizer hyperparameters, the caller's ``extra``) and the serialization
headers (about 1.5 KiB per chunk) come on top, so the progress lines stop short of 100% and the
file lines give the real sizes. The count is also what :func:`hybridshard.save_checkpoint` reports
as the bytes the rank wrote.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.planner import WriteItemType

logger = logging.getLogger(__name__)

__all__ = ["ProgressWriter", "PROGRESS_INTERVAL_S"]

PROGRESS_INTERVAL_S = 1.0
"""The least time between two progress lines of one rank (a finished file is always logged)."""
_STEPS = 10


def _planned_bytes(item: Any) -> int:
    if item.type == WriteItemType.BYTE_IO or item.tensor_data is None:
        return 0
    numel = 1
    for size in item.tensor_data.size:
        numel *= size
    return numel * torch.empty((), dtype=item.tensor_data.properties.dtype).element_size()


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


class _Progress:
    """One rank's running count; writer threads share it."""

    def __init__(self, label: str, rank: int, total: int) -> None:
        self.label, self.rank, self.total = label, rank, total
        self.written = 0
        self._lock = threading.Lock()
        self._t0 = self._last = time.perf_counter()
        self._next_step = 1

    def add(self, n: int) -> None:
        with self._lock:
            self.written += n
            if self.written >= self.total or self.written * _STEPS < self._next_step * self.total:
                return  # past the planned bytes only headers and small entries are left: the file line follows
            self._next_step = self.written * _STEPS // self.total + 1
            now = time.perf_counter()
            if now - self._last >= PROGRESS_INTERVAL_S:
                self._last = now
                logger.info("save %s: rank %d wrote %s of %s (%.0f%%) in %.1f s", self.label, self.rank,
                            _size(self.written), _size(self.total), 100 * self.written / self.total, now - self._t0)

    def file_done(self, name: str, nbytes: int) -> None:
        with self._lock:
            logger.info("save %s: rank %d finished %s: %s (%s in all) in %.1f s", self.label, self.rank, name,
                        _size(nbytes), _size(self.written), time.perf_counter() - self._t0)


class _CountingStream:
    """A write stream that counts what passes through it; everything else goes to the file."""

    def __init__(self, raw: Any, progress: _Progress) -> None:
        self._raw, self._progress = raw, progress
        self.written = 0

    def write(self, data: Any) -> int:
        n = self._raw.write(data)
        n = len(memoryview(data).cast("B")) if n is None else n
        self.written += n
        self._progress.add(n)
        return n

    def __getattr__(self, name: str) -> Any:  # tell, flush, fileno, ...
        return getattr(self._raw, name)


class _CountingFileSystem(FileSystem):
    def __init__(self, progress: _Progress) -> None:
        super().__init__()
        self.progress = progress

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[Any]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _CountingStream(raw, self.progress)
            yield stream
        self.progress.file_done(os.path.basename(os.fspath(path)), stream.written)


class ProgressWriter(dcp.FileSystemWriter):
    """``FileSystemWriter`` that logs each rank's progress; see [Note: save progress]."""

    def __init__(self, path: str | os.PathLike, *, label: str, rank: int, **kwargs: Any) -> None:
        super().__init__(path, **kwargs)
        self._label, self._rank = label, rank
        self.bytes_written = 0
        """What this rank wrote into its data files, once :meth:`write_data` returned."""

    def write_data(self, plan, planner):  # noqa: ANN001 - DCP's signature
        progress = _Progress(self._label, self._rank, sum(_planned_bytes(item) for item in plan.items))
        plain_fs, self.fs = self.fs, _CountingFileSystem(progress)
        try:
            return super().write_data(plan, planner)  # writes before returning (a completed future)
        finally:
            self.fs = plain_fs
            self.bytes_written = progress.written
