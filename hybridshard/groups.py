"""``init_groups``: discover the cluster and build this rank's shard and replicate groups."""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from hybridshard.topology.cluster import gather_cluster
from hybridshard.topology.groups import ShardGroups, build_groups
from hybridshard.topology.planner import plan_groups
from hybridshard.topology.records import RankProbe

logger = logging.getLogger(__name__)

__all__ = ["ShardGroups", "init_groups", "local_device"]


def local_device(probe: RankProbe) -> torch.device:
    """The device a rank computes on: its GPU as topology found it, else the CPU.

    NVML numbers physical GPUs; CUDA numbers the visible ones. The rank's GPU is located in its
    visible list by UUID, which is the CUDA ordinal.
    """
    if not torch.cuda.is_available():
        return torch.device("cpu")
    if probe.gpu_uuid is not None and probe.gpu_uuid in probe.visible_gpu_uuids:
        return torch.device("cuda", probe.visible_gpu_uuids.index(probe.gpu_uuid))
    # NVML could not tell (no library, or a failed query): fall back to torchrun's convention.
    return torch.device("cuda", probe.local_rank % torch.cuda.device_count())


def init_groups(*, shard_size: int | None = None, domain: str = "node") -> ShardGroups:
    """Probe every rank, gather the cluster view, plan the groups and build them.

    Collective over the default process group: every rank must call it with the same arguments.
    Raises ``ValueError`` (on every rank alike, since every rank plans from the same view) when the
    cluster cannot be tiled as asked.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_groups needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (under torchrun or `hybridshard launch`)"
        )
    from hybridshard.topology.probe import probe_rank

    probe = probe_rank(rank=dist.get_rank(), world_size=dist.get_world_size())
    device = local_device(probe)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cluster = gather_cluster(probe)
    plan = plan_groups(cluster, shard_size=shard_size, domain=domain)
    for note in plan.notes:
        if dist.get_rank() == 0:
            logger.warning("group plan: %s", note)
    return build_groups(plan, cluster=cluster, device=device)
