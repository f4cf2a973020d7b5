"""Build the ``torch.distributed`` groups and the 2-D ``DeviceMesh`` of a :class:`GroupPlan`.

[Note: every rank creates every group]
Creating a process group is collective over the default group: every rank must create every group,
members or not, in the same order, or the job hangs. ``build_groups`` creates all shard groups, then
all replicate groups, in plan order, which is identical on every rank because the plan is a pure
function of the gathered cluster view (see [Note: canonical order] in planner.py).

[Note: scalable creation]
With NCCL and a default group bound to a device (``init_process_group(device_id=...)``), one
``split_group`` call per kind of group creates every rank's communicator through a single
communicator split, instead of one store rendezvous per group. Otherwise (gloo, or an unbound
default group) the groups are created one by one with ``new_group``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Sequence

import torch
import torch.distributed as dist

from hybridshard.topology.planner import GroupPlan
from hybridshard.topology.records import ClusterView

logger = logging.getLogger(__name__)

__all__ = ["MESH_DIM_NAMES", "ShardGroups", "build_groups"]

MESH_DIM_NAMES = ("replicate", "shard")


@dataclass(frozen=True)
class ShardGroups:
    """This rank's groups for hybrid sharding."""

    shard: dist.ProcessGroup
    """The ranks this rank shards parameters with (one fast domain)."""
    replicate: dist.ProcessGroup
    """The ranks holding the same shard in other domains; gradient shards are all-reduced here."""
    mesh: Any
    """A 2-D ``DeviceMesh`` named ``("replicate", "shard")`` over the same groups, or ``None``."""
    plan: GroupPlan
    cluster: ClusterView | None = None
    """The cluster view the plan came from, when known."""
    device: torch.device | None = None
    """The device this rank computes on: its GPU as topology found it, else the CPU."""

    @property
    def shard_size(self) -> int:
        return self.plan.shard_size

    @property
    def replicate_size(self) -> int:
        return self.plan.replicate_size

    @property
    def shard_rank(self) -> int:
        return dist.get_rank(self.shard)

    @property
    def replicate_rank(self) -> int:
        return dist.get_rank(self.replicate)


def _split_capable(default_pg: dist.ProcessGroup) -> bool:
    if getattr(default_pg, "bound_device_id", None) is None:
        return False
    try:
        return "nccl" in str(dist.get_backend(default_pg)).lower()
    except (RuntimeError, ValueError):
        return False


def job_timeout(default_pg: dist.ProcessGroup) -> timedelta | None:
    """The timeout the job chose (``init_process_group(timeout=...)``), or ``None`` if unreadable.

    Subgroups do not inherit it: they get the backend's default (30 minutes for gloo), so a rank
    lost during a shard-group collective would hang its peers that long whatever the user set.
    """
    try:
        device = torch.device("cuda") if "nccl" in str(dist.get_backend(default_pg)).lower() else torch.device("cpu")
        return default_pg._get_backend(device).options._timeout
    except (AttributeError, RuntimeError, ValueError):
        return None


def _create(rank_lists: Sequence[Sequence[int]], kind: str, backend: str | None) -> dist.ProcessGroup:
    """Create every group of ``rank_lists`` (see [Note: every rank creates every group])."""
    rank = dist.get_rank()
    default_pg = dist.distributed_c10d._get_default_group()
    timeout = job_timeout(default_pg)
    if backend is None and _split_capable(default_pg):
        mine = dist.split_group(split_ranks=[list(r) for r in rank_lists], timeout=timeout, group_desc=kind)
        logger.debug("created %d %s groups with split_group", len(rank_lists), kind)
    else:
        mine = None
        for i, ranks in enumerate(rank_lists):
            pg = dist.new_group(list(ranks), backend=backend, timeout=timeout, group_desc=f"{kind}{i}")
            if rank in ranks:
                mine = pg
        logger.debug("created %d %s groups with new_group", len(rank_lists), kind)
    if mine is None:
        raise RuntimeError(f"rank {rank} is in none of the {kind} groups; the plan does not cover this job")
    return mine


def _device_type() -> str:
    try:
        backend = str(dist.get_backend()).lower()
    except (RuntimeError, ValueError):
        return "cpu"
    return "cuda" if "nccl" in backend and torch.cuda.is_available() else "cpu"


def _build_mesh(plan: GroupPlan, shard: dist.ProcessGroup, replicate: dist.ProcessGroup):
    from torch.distributed.device_mesh import DeviceMesh

    try:
        return DeviceMesh.from_group(
            [replicate, shard],
            _device_type(),
            mesh=torch.tensor(plan.mesh(), dtype=torch.int),
            mesh_dim_names=MESH_DIM_NAMES,
        )
    except Exception as err:  # noqa: BLE001 - the mesh is for interop; the groups are what we need
        logger.warning("could not build a DeviceMesh over the shard/replicate groups: %s", err)
        return None


def build_groups(
    plan: GroupPlan,
    *,
    backend: str | None = None,
    cluster: ClusterView | None = None,
    device: torch.device | None = None,
) -> ShardGroups:
    """Create the plan's groups (collective over the default group) and return this rank's."""
    if not dist.is_initialized():
        raise RuntimeError("build_groups needs an initialised default process group (init_process_group)")
    world_size = dist.get_world_size()
    if plan.world_size != world_size:
        raise ValueError(
            f"the plan is for {plan.world_size} ranks but this job has {world_size}; "
            "plan from a cluster view gathered in this job"
        )
    if plan.shard_size * plan.replicate_size != world_size:
        raise ValueError(
            f"shard size {plan.shard_size} x replicate size {plan.replicate_size} != world size {world_size}"
        )
    shard = _create(plan.shard_groups, "shard", backend)
    replicate = _create(plan.replicate_groups, "replicate", backend)
    mesh = _build_mesh(plan, shard, replicate)
    logger.info(
        "rank %d: shard group %s, replicate group %s",
        dist.get_rank(),
        plan.shard_group_of(dist.get_rank()),
        plan.replicate_group_of(dist.get_rank()),
    )
    return ShardGroups(shard=shard, replicate=replicate, mesh=mesh, plan=plan, cluster=cluster, device=device)
