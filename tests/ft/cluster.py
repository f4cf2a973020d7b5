"""Replica groups on 127.0.0.1 for fault-tolerance tests: each group its own job, one lighthouse."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = os.path.join(ROOT, "benchmarks", "ft_worker.py")


@dataclass
class Group:
    """One replica group: ``ranks`` processes with their own MASTER_PORT."""

    replica: int
    ranks: int
    logdir: str
    procs: list[subprocess.Popen] = field(default_factory=list)
    store: Any = None
    """The store of the group's current life (see :meth:`start`)."""

    def log(self, rank: int) -> str:
        return os.path.join(self.logdir, f"replica{self.replica}_rank{rank}.jsonl")

    def start(self, lighthouse: str, args: list[str]) -> None:
        # The group's store lives here, as torchrun's agent would host it: bound once on a port of the
        # kernel's choice and handed to the ranks (TORCHELASTIC_USE_AGENT_STORE: they connect, none binds),
        # a fresh one for each life of the group.
        self.store = dist.TCPStore("127.0.0.1", 0, self.ranks, is_master=True, wait_for_workers=False)
        self.procs = []
        for rank in range(self.ranks):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(self.ranks),
                       LOCAL_WORLD_SIZE=str(self.ranks), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(self.store.port),
                       TORCHELASTIC_USE_AGENT_STORE="True",
                       HYBRIDSHARD_NODE_NAME=f"node{self.replica}", TORCHFT_LIGHTHOUSE=lighthouse,
                       HYBRIDSHARD_REPLICA_ID=f"replica{self.replica}", OMP_NUM_THREADS="1",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""),
                       RUST_LOG="error")
            out = open(self.log(rank) + ".out", "ab")
            self.procs.append(subprocess.Popen([sys.executable, WORKER, "--out", self.log(rank), *args],
                                               env=env, stdout=out, stderr=subprocess.STDOUT))

    def kill(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGKILL)
        for p in self.procs:
            p.wait()

    def records(self, rank: int = 0) -> list[dict]:
        try:
            with open(self.log(rank)) as f:
                lines = f.read().split("\n")
        except FileNotFoundError:
            return []
        return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last one may be half-written

    def step(self) -> int:
        recs = self.records()
        return recs[-1]["step"] if recs else -1

    def wait(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        codes = []
        for p in self.procs:
            try:
                codes.append(p.wait(max(0.1, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
        return codes

    def output(self) -> str:
        parts = []
        for rank in range(self.ranks):
            try:
                with open(self.log(rank) + ".out", errors="replace") as f:
                    parts.append(f"--- replica{self.replica} rank{rank}\n" + f.read()[-3000:])
            except FileNotFoundError:
                pass
        return "\n".join(parts)


def wait_for(predicate, timeout: float, what: str, groups: list[Group]) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}\n" + "\n".join(g.output() for g in groups))
        for g in groups:
            for p in g.procs:
                if p.poll() not in (None, 0):
                    raise RuntimeError(f"replica{g.replica} exited with {p.returncode} while waiting for {what}\n"
                                       + g.output())
        time.sleep(0.05)
