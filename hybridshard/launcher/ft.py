"""``hybridshard launch --fault-tolerant``: each node its own one-node job, one lighthouse for all.

[Note: fault-tolerant launch]
In fault-tolerant mode (docs/fault-tolerance.md) a node is a replica group: its own
torch.distributed job, whose torchrun agent runs only its own ranks and restarts only them
(``--max-restarts``; a failure elsewhere never restarts this node). What the nodes share is the
lighthouse, torchft's quorum server. So the multi-node settings resolved as usual are turned into a
one-node job per node: ``--nnodes 1`` with a c10d store on a free local port, the rendezvous id
``replica<node rank>``, and the worker environment gets ``TORCHFT_LIGHTHOUSE`` and
``HYBRIDSHARD_REPLICA_ID=replica<node rank>`` (a node that comes back reuses its id). The lighthouse
is ``--lighthouse HOST:PORT`` when given; otherwise node rank 0's launcher starts one on the
rendezvous host at port :data:`LIGHTHOUSE_PORT` and every node points there. A lighthouse started
that way dies with node 0: give ``--lighthouse`` (a lighthouse on a machine apart) when node 0 may
be lost too.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import sys

from hybridshard.launcher.settings import LaunchSettings, Source

logger = logging.getLogger(__name__)

__all__ = ["LIGHTHOUSE_PORT", "FaultTolerantLaunch", "fault_tolerant"]

LIGHTHOUSE_PORT = 29510
"""Where node 0's launcher starts the lighthouse when no ``--lighthouse`` is given (torchft's default)."""

HEARTBEAT_MS = 1000
"""A replica group silent this long is dead: the next quorum forms without it."""


@dataclasses.dataclass(frozen=True)
class FaultTolerantLaunch:
    """One node's part of a fault-tolerant job: its settings, worker variables and lighthouse."""

    settings: LaunchSettings
    env: tuple[tuple[str, str], ...]
    lighthouse_argv: tuple[str, ...] | None
    """The lighthouse this launcher starts (node 0 without ``--lighthouse``), or ``None``."""


def _lighthouse_binary() -> str:
    found = shutil.which("torchft_lighthouse", path=os.path.dirname(sys.executable) + os.pathsep
                         + os.environ.get("PATH", ""))
    if found is None:
        raise ImportError(
            "hybridshard launch --fault-tolerant starts torchft's lighthouse (torchft_lighthouse), which is "
            "not installed; install it with: pip install hybridshard[ft], or pass --lighthouse HOST:PORT"
        )
    return found


def fault_tolerant(settings: LaunchSettings, lighthouse: str | None, *, max_restarts: int | None = None) -> FaultTolerantLaunch:
    """This node's one-node job; see [Note: fault-tolerant launch]."""
    if not settings.node_rank_fixed or ":" in settings.nnodes:
        raise ValueError(
            f"--fault-tolerant needs a fixed node rank per node (each node is replica group <node rank>), found "
            f"--nnodes {settings.nnodes} with the {settings.rdzv_backend} rendezvous; pass --nnodes N --node-rank I "
            "(or run under SLURM)"
        )
    if lighthouse is not None and ":" not in lighthouse.removeprefix("http://"):
        raise ValueError(f"--lighthouse must be HOST:PORT, found {lighthouse!r}")
    argv = None
    if lighthouse is None:
        host = f"[{settings.rdzv_host}]" if ":" in settings.rdzv_host else settings.rdzv_host
        lighthouse = f"{host}:{LIGHTHOUSE_PORT}"
        if settings.node_rank == 0:
            argv = (_lighthouse_binary(), "--bind", f"[::]:{LIGHTHOUSE_PORT}", "--min_replicas", "1",
                    "--join_timeout_ms", str(HEARTBEAT_MS), "--heartbeat_timeout_ms", str(HEARTBEAT_MS))
    url = lighthouse if lighthouse.startswith("http://") else f"http://{lighthouse}"
    replica = f"replica{settings.node_rank}"
    local = dataclasses.replace(
        settings, nnodes="1", node_rank=0, rdzv_backend="c10d", rdzv_host="127.0.0.1", rdzv_port=0,
        rdzv_id=replica, max_restarts=max_restarts, sources=settings.sources + (("fault_tolerant", Source.OPTION),),
    )
    env = [("TORCHFT_LIGHTHOUSE", url), ("HYBRIDSHARD_REPLICA_ID", replica), ("HYBRIDSHARD_FT_NODES", settings.nnodes),
           ("HYBRIDSHARD_FT_CONSOLE", "1")]  # see [Note: membership lines] in hybridshard/ft/membership.py
    return FaultTolerantLaunch(settings=local, env=tuple(env), lighthouse_argv=argv)
