"""The network while a local cluster's job runs: the spine's counters logged, and the changes made
mid-job (the cut of ``--cut-spine-*``, the rates of ``--set-rate``).

:class:`NetWatch` samples every rack uplink's counters (:meth:`LocalNetwork.spine_bytes
<hybridshard.launcher.netns.LocalNetwork.spine_bytes>`) once a second into
``<run directory>/spine-bytes.jsonl`` when the hosts sit in racks, one JSON object a line::

    {"time": 1718000000.25, "event": "sample", "racks": {"pod0/rack0": [tx, rx], "pod0/rack1": [tx, rx]}}

(``event`` is ``"start"`` for the first line, ``"cut"`` for the reading taken as the spine is cut,
``"end"`` for the last), so a caller reads the bytes over the spine between any two times of its own
job. At the end it prints what each uplink moved. It also makes each change once, after a number of
seconds or when a line of a host's output matches a pattern: cuts the spine (:class:`SpineCut`), or
shapes one host's link or the spine to a rate (:class:`RateChange`: a slow link or a slow spine, for
the straggler report's tests). Every change made is one line of ``<run directory>/net-events.jsonl``::

    {"time": 1718000012.5, "event": "rate", "target": "host3's link", "rate": "50mbit", "why": "..."}
"""

from __future__ import annotations

import json
import logging
import os
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Union

from hybridshard.launcher.netns import RATE_RE
from hybridshard.launcher.spine import bytes_text

if TYPE_CHECKING:
    from hybridshard.launcher.netns import LocalNetwork

logger = logging.getLogger(__name__)

__all__ = ["COUNTERS_FILE", "EVENTS_FILE", "NetWatch", "RateChange", "SpineCut", "read_counters"]

COUNTERS_FILE = "spine-bytes.jsonl"
EVENTS_FILE = "net-events.jsonl"
_SAMPLE_S = 1.0


def _check_trigger(after_s: float | None, when: str | None, after: str, when_opt: str) -> None:
    """One of ``after_s`` (seconds >= 0) and ``when`` (a regular expression), named by their options."""
    if (after_s is None) == (when is None):
        raise ValueError(f"expected one of {after} or {when_opt}, found "
                         f"{'both' if when is not None else 'neither'}; pass one of them")
    if after_s is not None and after_s < 0:
        raise ValueError(f"expected {after} >= 0 seconds, found {after_s}; pass e.g. 20")
    if when is not None:
        try:
            re.compile(when)
        except re.error as exc:
            raise ValueError(f"expected {when_opt} to be a regular expression, found {when!r} "
                             f"({exc}); quote or escape it") from None


@dataclass(frozen=True)
class SpineCut:
    """Cut the spine (every rack's uplink down) once: ``after_s`` seconds after the hosts started, or
    when a line of any host's output matches ``when``."""

    after_s: float | None = None
    when: str | None = None

    def __post_init__(self) -> None:
        _check_trigger(self.after_s, self.when, "--cut-spine-after", "--cut-spine-when")


@dataclass(frozen=True)
class RateChange:
    """Shape a link to ``rate`` (a tc rate) once, mid-job: host ``host``'s link (both ends of its veth),
    or the spine (every rack's uplink) when ``host`` is ``None``; ``after_s`` seconds after the hosts
    started, or when a line of any host's output matches ``when``."""

    rate: str
    host: int | None = None
    after_s: float | None = None
    when: str | None = None

    def __post_init__(self) -> None:
        if not RATE_RE.match(self.rate):
            raise ValueError(f"expected a tc rate in --set-rate, found {self.rate!r}; pass e.g. host3=50mbit "
                             "or spine=100mbit")
        if self.host is not None and self.host < 0:
            raise ValueError(f"expected a host index >= 0 in --set-rate, found {self.host}; pass e.g. host3=50mbit")
        _check_trigger(self.after_s, self.when, "--set-rate-after", "--set-rate-when")

    @property
    def target(self) -> str:
        return "the spine" if self.host is None else f"host{self.host}'s link"

    @classmethod
    def parse(cls, text: str, *, after_s: float | None = None, when: str | None = None) -> "RateChange":
        """``host<K>=RATE`` or ``spine=RATE`` (``--set-rate``)."""
        target, _, rate = text.partition("=")
        if target == "spine":
            return cls(rate, None, after_s, when)
        if re.fullmatch(r"host\d+", target):
            return cls(rate, int(target[4:]), after_s, when)
        raise ValueError(f"expected --set-rate host<K>=RATE or spine=RATE, found {text!r}; pass e.g. host3=50mbit")


Change = Union[SpineCut, RateChange]


def read_counters(path: str) -> list[dict]:
    """The lines of a ``spine-bytes.jsonl`` (or ``net-events.jsonl``) file, parsed."""
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class NetWatch:
    """Counters to the run directory (with racks), each change when due; one per run."""

    def __init__(self, net: LocalNetwork, say: Callable[[str], None], log_dir: str | None,
                 cut: SpineCut | None = None, changes: tuple[RateChange, ...] = ()) -> None:
        assert net.spine is not None or (cut is None and all(c.host is not None for c in changes)), \
            "cutting or shaping the spine needs a network with racks"
        self.net = net
        self.say = say
        self.path = None if log_dir is None or net.spine is None else os.path.join(log_dir, COUNTERS_FILE)
        self.events_path = None if log_dir is None else os.path.join(log_dir, EVENTS_FILE)
        self.cut = cut
        self.changes: tuple[Change, ...] = ((cut,) if cut is not None else ()) + tuple(changes)
        self.cut_at: float | None = None
        """``time.time()`` of the cut, once made."""
        self.done_at: dict[int, float] = {}
        """Index in :attr:`changes` -> ``time.time()`` it was made."""
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._first: dict[int, tuple[int, int]] = {}
        self._started = 0.0

    def start(self) -> None:
        self._started = time.monotonic()
        if self.net.spine is not None:
            self._first = self._sample("start")
        self._thread = threading.Thread(target=self._loop, name="local-cluster-net", daemon=True)
        self._thread.start()

    def _append(self, path: str | None, record: dict) -> None:
        if path is None:
            return
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "a") as f:
                f.write(json.dumps(record) + "\n")
        except OSError:
            logger.warning("could not write to %s", path, exc_info=True)

    def _sample(self, event: str) -> dict[int, tuple[int, int]]:
        counts = self.net.spine_bytes()
        racks = {r.path: list(counts[r.index]) for r in self.net.spine.racks}
        with self._lock:
            self._append(self.path, {"time": round(time.time(), 3), "event": event, "racks": racks})
        return counts

    def _loop(self) -> None:
        while not self._stop.wait(_SAMPLE_S):
            try:
                elapsed = time.monotonic() - self._started
                for i, change in enumerate(self.changes):
                    if change.after_s is not None and elapsed >= change.after_s:
                        self._make(i, f"{change.after_s:g}s after the start")
                if self.net.spine is not None:
                    self._sample("sample")
            except Exception:  # noqa: BLE001 - counters and changes are a test tool: never take the run down
                logger.warning("local cluster network: a sample or a change failed", exc_info=True)

    def on_line(self, host: str, line: str) -> None:
        """:class:`~hybridshard.launcher.supervisor.Supervisor`'s watcher: the changes due on a matching line."""
        for i, change in enumerate(self.changes):
            if change.when is not None and i not in self.done_at and re.search(change.when, line):
                self._make(i, f"{host} printed a line matching {change.when!r}")

    def _make(self, i: int, why: str) -> None:
        with self._lock:
            if i in self.done_at:
                return
            self.done_at[i] = time.time()
        change = self.changes[i]
        if isinstance(change, SpineCut):
            self.cut_at = self.done_at[i]
            self.net.cut_spine()
            racks = ", ".join(r.path for r in self.net.spine.racks)
            self.say(f"cut the spine ({why}): every rack's uplink is down, racks {racks} lost each other")
            record = {"event": "cut", "target": "the spine"}
        else:
            if change.host is None:
                self.net.set_spine_rate(change.rate)
            else:
                self.net.set_host_rate(self.net.hosts[change.host], change.rate)
            self.say(f"shaped {change.target} to {change.rate} ({why})")
            record = {"event": "rate", "target": change.target, "rate": change.rate}
        with self._lock:
            self._append(self.events_path, {"time": round(time.time(), 3), **record, "why": why})
        if isinstance(change, SpineCut):
            self._sample("cut")

    def stop(self) -> str:
        """Stop sampling; the last reading is logged, and what each uplink moved is said and returned."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
        if not self._first:  # never started, stopped already, or no racks
            return ""
        first, self._first = self._first, {}
        try:
            text = bytes_text(first, self._sample("end"), self.net.spine.racks)
        except OSError as exc:  # the uplinks are gone (torn down from outside): the teardown must still run
            logger.warning("spine counters: no last reading: %s", exc)
            return ""
        self.say(f"bytes over the spine: {text}" + (f" (every reading: {self.path})" if self.path else ""))
        return text
