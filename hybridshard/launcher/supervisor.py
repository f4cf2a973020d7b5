"""The hosts' processes of a local cluster: started, their output streamed and watched, stopped.

:class:`Supervisor` starts one process per host, prefixes each line of its output with the host's
name, hands every line to an optional watcher (the fault injections of
:mod:`hybridshard.launcher.local_cluster`), and returns the first failure's exit status.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import IO, Callable

__all__ = ["HostFault", "RunState", "Supervisor", "TIMEOUT_EXIT"]

TIMEOUT_EXIT = 124
_PEER_GRACE_S = 15.0
"""How long the other hosts get after one fails, before they are stopped: longer than a surviving rank
takes to say why its collective failed (it asks for up to 3 s, 6 s more when the round's leader is
lost: [Note: one reading for the ranks asking at once] in hybridshard/runtime/faults/asks.py). With 5 s,
a loaded machine stopped a survivor before its traceback. Hosts that exit sooner end the wait."""
_TERM_GRACE_S = 5.0
_POLL_S = 0.1


@dataclass(frozen=True)
class HostFault:
    """Kill one host (its launcher, agent and workers: the whole process group) when a line of its
    output matches ``when``, and start it again ``restart_after`` seconds later (``None``: never).
    The host's exit is then no failure of the job. For fault-tolerant jobs (docs/fault-tolerance.md)."""

    host: int
    when: str
    restart_after: float | None = None

    def __post_init__(self) -> None:
        try:
            re.compile(self.when)
        except re.error as exc:
            raise ValueError(f"--kill-when must be a regular expression, found {self.when!r}: {exc}") from None
        if self.restart_after is not None and self.restart_after < 0:
            raise ValueError(f"--restart-after must be >= 0 seconds, found {self.restart_after}")


class RunState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


class Supervisor:
    """Starts one process per host, streams their output, and stops them all."""

    def __init__(self, out: IO[str], fault: HostFault | None = None,
                 kill_host: Callable[[str], None] | None = None,
                 on_line: Callable[[str, str], None] | None = None) -> None:
        """``on_line(host, line)`` sees every line of every host, on that host's reader thread."""
        self.out = out
        self.on_line = on_line
        self.lock = threading.Lock()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.threads: list[threading.Thread] = []
        self.state = RunState.STARTING
        self.fault = fault
        self._kill_host = kill_host
        self._fault_name = f"host{fault.host}" if fault is not None else None
        self._fault_seen = threading.Event()
        self._started: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        self._started[name] = (argv, env)
        t = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        t.start()
        self.threads.append(t)

    def _pump(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        watch = self.fault is not None and name == self._fault_name
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if watch and not self._fault_seen.is_set() and re.search(self.fault.when, line):
                self._fault_seen.set()
            if self.on_line is not None:
                self.on_line(name, line)
            with self.lock:
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()

    def _inject_fault(self, state: dict) -> None:
        """Kill the fault's host once its output matched, start it again when due; see :class:`HostFault`."""
        if not self._fault_seen.is_set():
            return
        name, now = self._fault_name, time.monotonic()
        if "killed" not in state:
            proc = dict(self.procs)[name]
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._kill_host is not None:
                self._kill_host(name)
            proc.wait()
            state["killed"] = now
            self.say(f"killed {name} (every process of it)" + (
                f"; starting it again in {self.fault.restart_after:g}s" if self.fault.restart_after is not None else ""))
        elif (self.fault.restart_after is not None and "restarted" not in state
              and now >= state["killed"] + self.fault.restart_after):
            state["restarted"] = now
            self.say(f"starting {name} again")
            self.start(name, *self._started[name])

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"[local-cluster] {text}\n")
            self.out.flush()

    def wait(self, timeout_s: float | None) -> int:
        """Wait for every host; return the first failure's status (0 when all succeed)."""
        self.state = RunState.RUNNING
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_failure: tuple[str, int] | None = None
        peers_deadline = None
        fault_state: dict = {}
        while True:
            self._inject_fault(fault_state)
            codes = [(name, p.poll()) for name, p in self.procs]
            if "killed" in fault_state and "restarted" not in fault_state:
                codes = [(n, rc) for n, rc in codes if n != self._fault_name]  # killed on purpose
            for name, rc in codes:
                if rc not in (None, 0) and first_failure is None:
                    first_failure = (name, rc)
                    peers_deadline = time.monotonic() + _PEER_GRACE_S
                    self.say(f"{name} failed with exit status {rc}; stopping the other hosts in {_PEER_GRACE_S:.0f}s")
            if all(rc is not None for _, rc in codes):
                break
            now = time.monotonic()
            if peers_deadline is not None and now > peers_deadline:
                self.stop()
                break
            if deadline is not None and now > deadline:
                self.say(f"timed out after {timeout_s:.0f}s; stopping every host")
                self.stop()
                return TIMEOUT_EXIT
            time.sleep(_POLL_S)
        self.join_output()
        if first_failure is None:
            return 0
        rc = first_failure[1]
        return 128 - rc if rc < 0 else rc

    def stop(self) -> None:
        """SIGTERM every host's process group, then SIGKILL what is left."""
        self.state = RunState.STOPPING
        for sig, grace in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 2.0)):
            live = [p for _, p in self.procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + grace
            while any(p.poll() is None for p in live) and time.monotonic() < end:
                time.sleep(_POLL_S)
        self.join_output()

    def join_output(self) -> None:
        for t in self.threads:
            t.join(timeout=2.0)
        self.state = RunState.DONE
