"""The spine while a local cluster's job runs: its byte counters logged, and the cut of ``--cut-spine-*``.

:class:`SpineWatch` samples every rack uplink's counters (:meth:`LocalNetwork.spine_bytes
<hybridshard.launcher.netns.LocalNetwork.spine_bytes>`) once a second into
``<run directory>/spine-bytes.jsonl``, one JSON object a line::

    {"time": 1718000000.25, "event": "sample", "racks": {"pod0/rack0": [tx, rx], "pod0/rack1": [tx, rx]}}

(``event`` is ``"start"`` for the first line, ``"cut"`` for the reading taken as the spine is cut,
``"end"`` for the last), so a caller reads the bytes over the spine between any two times of its own
job. At the end it prints what each uplink moved. It also cuts the spine once (:class:`SpineCut`):
after a number of seconds, or when a line of a host's output matches a pattern.
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from hybridshard.launcher.spine import bytes_text

if TYPE_CHECKING:
    from hybridshard.launcher.netns import LocalNetwork

logger = logging.getLogger(__name__)

__all__ = ["COUNTERS_FILE", "SpineCut", "SpineWatch", "read_counters"]

COUNTERS_FILE = "spine-bytes.jsonl"
_SAMPLE_S = 1.0


@dataclass(frozen=True)
class SpineCut:
    """Cut the spine (every rack's uplink down) once: ``after_s`` seconds after the hosts started, or
    when a line of any host's output matches ``when``."""

    after_s: float | None = None
    when: str | None = None

    def __post_init__(self) -> None:
        if (self.after_s is None) == (self.when is None):
            raise ValueError(f"expected one of --cut-spine-after or --cut-spine-when, found "
                             f"{'both' if self.when is not None else 'neither'}; pass one of them")
        if self.after_s is not None and self.after_s < 0:
            raise ValueError(f"expected --cut-spine-after >= 0 seconds, found {self.after_s}; pass e.g. 20")
        if self.when is not None:
            try:
                re.compile(self.when)
            except re.error as exc:
                raise ValueError(f"expected --cut-spine-when to be a regular expression, found {self.when!r} "
                                 f"({exc}); quote or escape it") from None


def read_counters(path: str) -> list[dict]:
    """The lines of a ``spine-bytes.jsonl`` file, parsed."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class SpineWatch:
    """Counters to the run directory, the cut when due; one per run with racks."""

    def __init__(self, net: LocalNetwork, say: Callable[[str], None], log_dir: str | None,
                 cut: SpineCut | None = None) -> None:
        assert net.spine is not None, "a SpineWatch needs a network with racks"
        self.net = net
        self.say = say
        self.path = None if log_dir is None else os.path.join(log_dir, COUNTERS_FILE)
        self.cut = cut
        self.cut_at: float | None = None
        """``time.time()`` of the cut, once made."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[int, tuple[int, int]] = {}
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        self._first = self._sample("start")
        self._thread = threading.Thread(target=self._loop, name="local-cluster-spine", daemon=True)
        self._thread.start()

    def _sample(self, event: str) -> dict[int, tuple[int, int]]:
        counts = self.net.spine_bytes()
        if self.path is not None:
            racks = {r.path: list(counts[r.index]) for r in self.net.spine.racks}
            line = json.dumps({"time": round(time.time(), 3), "event": event, "racks": racks})
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                with self._lock, open(self.path, "a") as f:
                    f.write(line + "\n")
            except OSError:
                logger.warning("could not write the spine counters to %s", self.path, exc_info=True)
        return counts

    def _loop(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            try:
                if self.cut is not None and self.cut.after_s is not None and \
                        time.monotonic() - self._started >= self.cut.after_s:
                    self._cut(f"{self.cut.after_s:g}s after the start")
                self._sample("sample")
            except Exception:  # noqa: BLE001 - counters are a report: never take the run down
                logger.warning("spine counters: sampling failed", exc_info=True)

    def on_line(self, host: str, line: str) -> None:
        """:class:`~hybridshard.launcher.supervisor.Supervisor`'s watcher: the cut on a matching line."""
        if self.cut is not None and self.cut.when is not None and self.cut_at is None and re.search(self.cut.when, line):
            self._cut(f"{host} printed a line matching {self.cut.when!r}")

    def _cut(self, why: str) -> None:
        with self._lock:
            if self.cut_at is not None:
                return
            self.cut_at = time.time()
        self.net.cut_spine()
        racks = ", ".join(r.path for r in self.net.spine.racks)
        self.say(f"cut the spine ({why}): every rack's uplink is down, racks {racks} lost each other")
        self._sample("cut")

    def stop(self) -> str:
        """Stop sampling; the last reading is logged, and what each uplink moved is said and returned."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not self._first:  # never started, or stopped already
            return ""
        first, self._first = self._first, {}
        try:
            text = bytes_text(first, self._sample("end"), self.net.spine.racks)
        except OSError as exc:  # the uplinks are gone (torn down from outside): the teardown must still run
            logger.warning("spine counters: no last reading: %s", exc)
            return ""
        self.say(f"bytes over the spine: {text}" + (f" (every reading: {self.path})" if self.path else ""))
        return text
