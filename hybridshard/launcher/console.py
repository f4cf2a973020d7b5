"""What of one node's torchrun output reaches the console.

torchrun writes each rank's output to its files (see [Note: run directory] in :mod:`.runlog`) and
tees the shown ranks' lines to its own stdout/stderr, prefixed ``[rank<R>] ``
(:data:`hybridshard.launcher.agent.RANK_PREFIX_TEMPLATE`). The launcher reads torchrun's two streams line by line and
(:class:`ConsoleFilter`): passes those rank lines and the agent's own ``[hybridshard]`` lines to the
console; sends everything else (torchrun's warnings, its failure banner) to ``torchrun.log``; and,
unless verbose, folds a Python traceback in a rank's lines into its last line — the exception,
whose message follows — since the summary shows the root cause's traceback once and the others'
are consequences. Nothing is lost: every rank's full output is in its own log.
"""

from __future__ import annotations

import re
import threading
from typing import IO

from hybridshard.launcher.agent import ANNOUNCE

__all__ = ["ConsoleFilter"]

_RANK_LINE = re.compile(r"^(\[rank\d+\] )(.*)$")
_CHAIN = ("During handling of the above exception", "The above exception was the direct cause")


class ConsoleFilter:
    """Routes lines of torchrun's output; thread-safe (one reader thread per stream)."""

    def __init__(self, console: IO[str], log: IO[str], *, verbose: bool = False) -> None:
        self.console = console
        self.log = log
        self.verbose = verbose
        self.lock = threading.Lock()
        self._state: dict[str, tuple[bool, list[str]]] = {}
        """Per rank prefix: inside a traceback, and the lines held back (see :meth:`_fold`)."""
        self.folded = 0
        """Traceback lines kept off the console."""

    def feed(self, line: str) -> None:
        line = line.rstrip("\n")
        with self.lock:
            match = _RANK_LINE.match(line)
            if match is not None:
                prefix, text = match.group(1), match.group(2)
                # torch's own excepthook prefixes a rank's traceback lines with "[rank<R>]:" too.
                text = text.removeprefix(prefix[:-1] + ":").removeprefix(" ")
                if self.verbose:
                    self._write(self.console, prefix + text)
                else:
                    for shown in self._fold(prefix, text):
                        self._write(self.console, prefix + shown)
            elif line.startswith(ANNOUNCE):
                self._write(self.console, line)
            else:
                self._write(self.log, line)
                if self.verbose:
                    self._write(self.console, line)

    def _fold(self, prefix: str, text: str) -> list[str]:
        """The lines to show for a rank's line ``text``: a traceback, chained ones included, is shown as
        its last exception line (held until the next line tells whether another traceback follows)."""
        inside, held = self._state.get(prefix, (False, []))
        starts = text.startswith(("Traceback (most recent call last):", *_CHAIN))
        if held and (starts or (not text and len(held) == 1)):
            self.folded += len(held) if starts else 0
            self._state[prefix] = (True, [] if starts else held + [text])
            return []
        if held:
            self._state[prefix] = (False, [])
            return held + self._fold(prefix, text)
        if starts or (inside and (not text or text[0].isspace())):
            self.folded += 1
            self._state[prefix] = (True, [])
            return []
        if inside:  # the exception line that ends a traceback
            self._state[prefix] = (True, [text])
            return []
        return [text]

    def close(self) -> None:
        """Show what is still held (a traceback's last line at the end of the output)."""
        with self.lock:
            for prefix, (_, held) in self._state.items():
                for text in held:
                    self._write(self.console, prefix + text)
            self._state.clear()

    @staticmethod
    def _write(stream: IO[str], line: str) -> None:
        stream.write(line + "\n")
        stream.flush()
