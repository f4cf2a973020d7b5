"""Worker entry used by ``hybridshard launch --bind-numa``: pin this process, then run the real program.

torchrun starts ``python -m hybridshard.launcher.bind MODE TARGET ARGS...`` for every local rank. It
reads ``LOCAL_RANK`` and the launcher's binding (``HYBRIDSHARD_CPU_BINDING``), calls
``os.sched_setaffinity`` and ``exec``s the program in the same process, so the pid torchrun watches,
the environment and the signals are unchanged and every thread the program starts inherits the CPU
set. See [Note: NUMA binding] in :mod:`hybridshard.launcher.numa`.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping, Sequence

from hybridshard.launcher.numa import BINDING_ENV, cpus_from_env

_MODES = ("script", "module", "exec")


def exec_argv(mode: str, target: str, args: Sequence[str], python: str = sys.executable) -> list[str]:
    if mode == "script":
        return [python, "-u", target, *args]
    if mode == "module":
        return [python, "-u", "-m", target, *args]
    if mode == "exec":
        return [target, *args]
    raise ValueError(f"bind mode must be one of {_MODES}, found {mode!r}")


def cpus_for_this_rank(env: Mapping[str, str]) -> tuple[int, ...]:
    value = env.get(BINDING_ENV)
    if not value:
        raise RuntimeError(f"{BINDING_ENV} is not set; run this module through `hybridshard launch --bind-numa`")
    local_rank = env.get("LOCAL_RANK")
    if local_rank is None or not local_rank.isdigit():
        raise RuntimeError(f"LOCAL_RANK is {local_rank!r}; run this module under torchrun")
    return cpus_from_env(value, int(local_rank))


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) < 2:
        print(f"usage: python -m hybridshard.launcher.bind {{{','.join(_MODES)}}} TARGET [ARGS...]", file=sys.stderr)
        return 2
    cmd = exec_argv(argv[0], argv[1], argv[2:])
    cpus = cpus_for_this_rank(os.environ)
    os.sched_setaffinity(0, cpus)
    os.execvp(cmd[0], cmd)
    return 127  # not reached: execvp replaces the process or raises


if __name__ == "__main__":
    sys.exit(main())
