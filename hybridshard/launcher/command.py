"""Build and run the torchrun command of one node.

The launcher never re-implements torchrun: it resolves settings (:mod:`.settings`), then runs
torchrun as a child process with exactly the argv ``--dry-run`` prints: ``python -m
hybridshard.launcher.agent``, torchrun that leaves the node's record of the run (see [Note: the node
record]), when the run has a log directory, else ``python -m torch.distributed.run``.
With NUMA binding, torchrun launches :mod:`hybridshard.launcher.bind` as the worker entry, which pins
the worker to its CPU set and then ``exec``s the user's program (see [Note: NUMA binding]).
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from enum import Enum
from typing import IO, Mapping, Sequence

from hybridshard.launcher.console import ConsoleFilter
from hybridshard.launcher.numa import BINDING_ENV, CpuBinding
from hybridshard.launcher.runlog import TORCHRUN_LOG, NodeLogs
from hybridshard.launcher.settings import NCCL_FAULT_DEFAULTS, LaunchSettings

logger = logging.getLogger(__name__)

__all__ = ["EntryMode", "Entry", "LaunchCommand", "make_entry", "build_command", "run_command"]

_PYTHON_NAME = re.compile(r"^python(\d+(\.\d+)?)?$")
_FORWARDED_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
_SHOWN_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_", "HYBRIDSHARD_")
_SHOWN_ENV_NAMES = ("CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS", "PYTHONPATH")


class EntryMode(str, Enum):
    """How torchrun starts each worker."""

    SCRIPT = "script"
    """``python -u SCRIPT ARGS``."""
    MODULE = "module"
    """``python -u -m MODULE ARGS`` (torchrun ``-m``)."""
    EXEC = "exec"
    """``PROGRAM ARGS`` with no interpreter (torchrun ``--no-python``)."""


@dataclass(frozen=True)
class Entry:
    """The program every worker runs."""

    mode: EntryMode
    target: str
    args: tuple[str, ...] = ()


def _is_python_file(path: str) -> bool:
    if path.endswith(".py"):
        return True
    try:
        with open(path, "rb") as f:
            first = f.readline(200)
    except OSError:
        return False
    return first.startswith(b"#!") and b"python" in first


def make_entry(argv: Sequence[str], *, module: bool = False, no_python: bool = False) -> Entry:
    """Turn ``SCRIPT ARGS`` / ``python -m MOD ARGS`` / ``PROGRAM ARGS`` into an :class:`Entry`.

    ``module`` and ``no_python`` are torchrun's ``-m`` and ``--no-python`` when the user gave them.
    """
    if not argv:
        raise ValueError("no program to launch; expected SCRIPT [ARGS...] or python -m MODULE [ARGS...] after the options")
    head, rest = argv[0], tuple(argv[1:])
    if module and no_python:
        raise ValueError("-m and --no-python contradict each other; pass one")
    if module:
        return Entry(EntryMode.MODULE, head, rest)
    if no_python:
        return Entry(EntryMode.EXEC, head, rest)
    if _PYTHON_NAME.match(os.path.basename(head)):
        if len(rest) >= 2 and rest[0] == "-m":
            return Entry(EntryMode.MODULE, rest[1], rest[2:])
        if rest and not rest[0].startswith("-"):
            return Entry(EntryMode.SCRIPT, rest[0], rest[1:])
        return Entry(EntryMode.EXEC, head, rest)
    if _is_python_file(head):
        return Entry(EntryMode.SCRIPT, head, rest)
    if not os.path.exists(head) and shutil.which(head) is None:
        raise ValueError(f"program {head!r} not found: neither a file nor a command on PATH; check the path")
    return Entry(EntryMode.EXEC, head, rest)


@dataclass(frozen=True)
class LaunchCommand:
    """One node's torchrun command: the argv and the variables set on top of the inherited environment."""

    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    settings: LaunchSettings
    binding: CpuBinding | None = None
    logs: NodeLogs | None = None
    defaults: tuple[tuple[str, str], ...] = NCCL_FAULT_DEFAULTS
    """Variables set only when the inherited environment lacks them (see [Note: NCCL faults])."""

    def added(self, base: Mapping[str, str]) -> list[tuple[str, str]]:
        """The variables set on top of ``base``: the defaults it lacks, then ``env``."""
        names = {k for k, _ in self.env}
        return [(k, v) for k, v in self.defaults if k not in base and k not in names] + list(self.env)

    def environ(self, base: Mapping[str, str]) -> dict[str, str]:
        merged = dict(base)
        merged.update(self.added(base))
        return merged

    def render(self, base_env: Mapping[str, str]) -> str:
        """The ``--dry-run`` text: a summary, the environment that matters, and the exact command."""
        s = self.settings
        node = f"node rank {s.node_rank}" if s.node_rank_fixed else "node rank assigned by the rendezvous"
        lines = [
            f"# nnodes: {s.nnodes}, {node}, nproc-per-node: {s.nproc_per_node}",
            f"# rendezvous: c10d TCP store on host {s.rdzv_host} port {s.rdzv_port}"
            + (" (a free port)" if s.rdzv_port == 0 else "") + f", {s.rdzv_backend} rendezvous",
            "# sources: " + ", ".join(f"{k}={v.value}" for k, v in s.sources),
        ]
        if s.slurm_job_id is not None:
            lines.append(f"# SLURM job {s.slurm_job_id}")
        if s.restartable:
            lines.append(f"# restarts: up to {s.max_restarts or 0} per node, every node's workers together; "
                         "a new store for each attempt")
        if self.binding is not None:
            lines += [f"# {line}" for line in self.binding.describe()]
        if self.logs is not None:
            lines.append(f"# logs: each rank's output in {self.logs.node_dir}, "
                         + ("local rank 0's also on the console" if self.logs.show_rank0 else "none on the console"))
        added = self.added(base_env)
        set_names = {k for k, _ in added}
        defaults = added[: len(added) - len(self.env)]
        if defaults:
            lines.append("# defaults for what the environment leaves unset (see [Note: NCCL faults]): "
                         + " ".join(f"{k}={v}" for k, v in defaults))
        shown = sorted(
            (k, v) for k, v in base_env.items()
            if k not in set_names and (k.startswith(_SHOWN_ENV_PREFIXES) or k in _SHOWN_ENV_NAMES)
        )
        for k, v in shown:
            lines.append(f"# inherited: {k}={shlex.quote(v)}")
        lines.append("# environment: the current one, plus those defaults and the variables set below")
        prefix = ["env", *(f"{k}={v}" for k, v in self.env)] if self.env else []
        lines.append(shlex.join([*prefix, *self.argv]))
        return "\n".join(lines)


def build_command(
    settings: LaunchSettings,
    entry: Entry,
    *,
    passthrough: Sequence[str] = (),
    binding: CpuBinding | None = None,
    logs: NodeLogs | None = None,
    python: str = sys.executable,
) -> LaunchCommand:
    """The torchrun argv for ``entry`` under ``settings``; ``passthrough`` goes to torchrun unchanged
    (after the options for ``logs``, so that the user's ``--tee``/``--redirects`` win)."""
    runner = "torch.distributed.run" if logs is None else "hybridshard.launcher.agent"
    log_args = [] if logs is None else logs.torchrun_args()
    argv = [python, "-m", runner, *log_args, *settings.torchrun_args(), *passthrough]
    env: list[tuple[str, str]] = settings.worker_env()
    if binding is not None:
        if settings.nproc_int is None:
            raise ValueError(
                f"--bind-numa needs a numeric --nproc-per-node, found {settings.nproc_per_node!r}; pass a number"
            )
        env.append((BINDING_ENV, binding.to_env()))
        argv += ["-m", "hybridshard.launcher.bind", entry.mode.value, entry.target, *entry.args]
    elif entry.mode is EntryMode.MODULE:
        argv += ["-m", entry.target, *entry.args]
    elif entry.mode is EntryMode.EXEC:
        argv += ["--no-python", entry.target, *entry.args]
    else:
        argv += [entry.target, *entry.args]
    return LaunchCommand(argv=tuple(argv), env=tuple(env), settings=settings, binding=binding, logs=logs)


def _pump(stream: IO[bytes], console: ConsoleFilter) -> None:
    for raw in iter(stream.readline, b""):
        console.feed(raw.decode(errors="replace"))


def run_command(command: LaunchCommand, base_env: Mapping[str, str] | None = None, *, verbose: bool = False) -> int:
    """Run torchrun as a child; forward termination signals to it; return its exit status. With a log
    directory, torchrun's output goes through a :class:`ConsoleFilter` (its own lines to torchrun.log)."""
    env = command.environ(os.environ if base_env is None else base_env)
    logger.info("running: %s", shlex.join(command.argv))
    piped = command.logs is not None
    proc = subprocess.Popen(list(command.argv), env=env, stdout=subprocess.PIPE if piped else None,
                            stderr=subprocess.PIPE if piped else None)
    pumps: list[threading.Thread] = []
    log_file = console = None
    if piped:
        os.makedirs(command.logs.node_dir, exist_ok=True)
        log_file = open(os.path.join(command.logs.node_dir, TORCHRUN_LOG), "a")
        console = ConsoleFilter(sys.stdout, log_file, verbose=verbose)
        pumps = [threading.Thread(target=_pump, args=(s, console), daemon=True) for s in (proc.stdout, proc.stderr)]
        for t in pumps:
            t.start()

    def forward(signum: int, _frame: object) -> None:
        if proc.poll() is None:
            proc.send_signal(signum)

    previous = {}
    for sig in _FORWARDED_SIGNALS:
        try:
            previous[sig] = signal.signal(sig, forward)
        except ValueError:  # not the main thread: signals stay with their default handlers
            break
    try:
        rc = proc.wait()
        for t in pumps:
            t.join(timeout=10.0)
        if console is not None:
            console.close()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if log_file is not None:
            log_file.close()
    return 128 - rc if rc < 0 else rc
