"""What a SLURM allocation tells a launcher: node count, this node's index, and the host names.

``SLURM_JOB_NODELIST`` is compressed (``gpu[07-09,12]``, ``a[1-2],b3``, ``rack[1-2]-n[01-02]``).
:func:`expand_nodelist` expands it with ``scontrol show hostnames`` when that command exists and with
:func:`~hybridshard.topology.hostlist.parse_nodelist` (a parser shared with discovery) otherwise, so
the launcher also works in containers that see the SLURM environment but not the SLURM tools.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from hybridshard.topology.hostlist import parse_nodelist

logger = logging.getLogger(__name__)

__all__ = ["SlurmEnv", "parse_nodelist", "expand_nodelist", "slurm_from_env"]

_SCONTROL_TIMEOUT_S = 10.0


def _scontrol_hostnames(nodelist: str) -> tuple[str, ...] | None:
    exe = shutil.which("scontrol")
    if exe is None:
        return None
    try:
        done = subprocess.run(
            [exe, "show", "hostnames", nodelist],
            capture_output=True, text=True, timeout=_SCONTROL_TIMEOUT_S, check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        logger.debug("scontrol show hostnames failed (%s); using the built-in parser", exc)
        return None
    hosts = tuple(line.strip() for line in done.stdout.splitlines() if line.strip())
    if done.returncode != 0 or not hosts:
        logger.debug("scontrol show hostnames exited %s; using the built-in parser", done.returncode)
        return None
    return hosts


def expand_nodelist(
    nodelist: str, *, scontrol: Callable[[str], tuple[str, ...] | None] | None = _scontrol_hostnames
) -> tuple[str, ...]:
    """Expand with ``scontrol show hostnames`` when available, else with :func:`parse_nodelist`."""
    if scontrol is not None:
        hosts = scontrol(nodelist)
        if hosts:
            return hosts
    return parse_nodelist(nodelist)


@dataclass(frozen=True)
class SlurmEnv:
    """The SLURM facts a launcher uses; built by :func:`slurm_from_env`."""

    job_id: str
    num_nodes: int
    """``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``)."""
    node_id: int
    """``SLURM_NODEID``: this node's index in ``hosts``, 0-based."""
    hosts: tuple[str, ...]
    """``SLURM_JOB_NODELIST`` expanded, in allocation order; ``hosts[0]`` hosts the rendezvous."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"SLURM_NNODES must be >= 1, found {self.num_nodes}")
        if not 0 <= self.node_id < self.num_nodes:
            raise ValueError(
                f"SLURM_NODEID {self.node_id} is outside 0..{self.num_nodes - 1} (SLURM_NNODES={self.num_nodes}); "
                "run one task per node (srun --ntasks-per-node=1) so every task sees its node's id"
            )
        if len(self.hosts) != self.num_nodes:
            raise ValueError(
                f"SLURM_JOB_NODELIST expands to {len(self.hosts)} hosts {list(self.hosts)} but SLURM_NNODES is "
                f"{self.num_nodes}; pass --nnodes and --rdzv-endpoint explicitly if the allocation is unusual"
            )

    @property
    def first_host(self) -> str:
        return self.hosts[0]


def _int_var(env: Mapping[str, str], names: Sequence[str]) -> int | None:
    for name in names:
        raw = env.get(name)
        if raw is None or raw == "":
            continue
        try:
            return int(raw)
        except ValueError:
            raise ValueError(f"{name} must be an integer, found {raw!r}; is this a SLURM job step?") from None
    return None


def slurm_from_env(
    env: Mapping[str, str], *, scontrol: Callable[[str], tuple[str, ...] | None] | None = _scontrol_hostnames
) -> SlurmEnv | None:
    """The SLURM allocation described by ``env``, or ``None`` outside SLURM (no ``SLURM_JOB_ID``)."""
    job_id = env.get("SLURM_JOB_ID")
    if not job_id:
        return None
    num_nodes = _int_var(env, ("SLURM_NNODES", "SLURM_JOB_NUM_NODES"))
    node_id = _int_var(env, ("SLURM_NODEID",))
    nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
    missing = [name for name, value in (("SLURM_NNODES", num_nodes), ("SLURM_NODEID", node_id),
                                        ("SLURM_JOB_NODELIST", nodelist)) if value is None]
    if missing:
        raise ValueError(
            f"SLURM_JOB_ID is set but {', '.join(missing)} is not; run the launcher inside a job step "
            "(srun ... hybridshard launch ...), or pass --nnodes, --node-rank and --rdzv-endpoint"
        )
    assert num_nodes is not None and node_id is not None and nodelist is not None
    hosts = expand_nodelist(nodelist, scontrol=scontrol)
    return SlurmEnv(job_id=job_id, num_nodes=num_nodes, node_id=node_id, hosts=hosts)
