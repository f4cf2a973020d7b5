"""A progress bar for the benchmark, with no dependency: drawn on a terminal, sparse lines elsewhere.

[Note: bench progress]
Rank 0 counts work items (each contestant's warm-up, then each contestant's steps in each round).
Started by ``hybridshard bench`` (``--from-job``), it writes one machine-readable line per item,
``hybridshard-bench-progress DONE TOTAL LABEL``; the command's :class:`ProgressSink` turns those
lines into one bar on its own stderr, whatever launcher carried them (two agents on loopback, or
``launch/local-cluster``, which prefixes every line with its host). Started directly (under a
user's torchrun), rank 0 draws the bar itself.
"""

from __future__ import annotations

import sys
import threading
from typing import IO

__all__ = ["Progress", "ProgressSink", "render_bar"]

TAG = "hybridshard-bench-progress"
_WIDTH = 30


def render_bar(done: int, total: int, label: str) -> str:
    filled = _WIDTH * done // max(total, 1)
    return f"[{'#' * filled}{'.' * (_WIDTH - filled)}] {done}/{total} {label}"


class _Bar:
    """Redraws one line on a terminal; elsewhere prints a line at every tenth of the way."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = bool(getattr(stream, "isatty", lambda: False)())
        self.shown = ""
        self.last_tenth = -1

    def show(self, done: int, total: int, label: str) -> None:
        text = render_bar(done, total, label)
        if self.tty:
            self.stream.write("\r\033[K" + text)
            self.shown = text
        else:
            tenth = 10 * done // max(total, 1)
            if tenth == self.last_tenth:
                return
            self.last_tenth = tenth
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\r\033[K")
            self.stream.flush()

    def restore(self) -> None:
        if self.tty and self.shown:
            self.stream.write(self.shown)
            self.stream.flush()

    def finish(self) -> None:
        if self.tty and self.shown:
            self.stream.write("\n")
            self.stream.flush()
            self.shown = ""


class Progress:
    """Rank 0's side; see [Note: bench progress]. Does nothing on the other ranks."""

    def __init__(self, total: int, *, enabled: bool, machine: bool, stream: IO[str] | None = None) -> None:
        self.total, self.enabled, self.machine = total, enabled, machine
        self.stream = stream or sys.stderr
        self.done = 0
        self.bar = _Bar(self.stream)

    def advance(self, label: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self.machine:
            self.stream.write(f"{TAG} {self.done} {self.total} {label}\n")
            self.stream.flush()
        else:
            self.bar.show(self.done, self.total, label)

    def close(self) -> None:
        if self.enabled and not self.machine:
            self.bar.finish()


class ProgressSink:
    """A text stream for launcher output: progress lines become the bar, others pass through."""

    def __init__(self, stream: IO[str] | None = None) -> None:
        self.bar = _Bar(stream or sys.stderr)
        self.stream = self.bar.stream
        self.pending = ""
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            self.pending += text
            *lines, self.pending = self.pending.split("\n")
            for line in lines:
                self._line(line)
        return len(text)

    def _line(self, line: str) -> None:
        if TAG in line:
            fields = line.split(TAG, 1)[1].split(maxsplit=2)
            if len(fields) >= 2 and fields[0].isdigit() and fields[1].isdigit():
                self.bar.show(int(fields[0]), int(fields[1]), fields[2] if len(fields) > 2 else "")
                return
        self.bar.clear()
        self.stream.write(line + "\n")
        self.bar.restore()
        self.stream.flush()

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        with self.lock:
            if self.pending:
                self._line(self.pending)
                self.pending = ""
            self.bar.finish()
