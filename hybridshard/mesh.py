"""A ``DeviceMesh`` as the shard/replicate groups of :func:`hybridshard.shard` (``mesh=``).

[Note: meshes in]
FSDP2 and torchtitan users describe hybrid sharding with a ``DeviceMesh``: a 2-D mesh whose dim 0
replicates and dim 1 shards, built as ``init_device_mesh(device, (R, S),
mesh_dim_names=("replicate", "shard"))``. ``shard(..., mesh=...)`` accepts that mesh in place of
``groups=`` (a :class:`~hybridshard.ShardGroups`, whose ``.mesh`` is such a mesh too):

- 2-D: the dims must be named ``("replicate", "shard")`` in that order (the order FSDP2 gives its
  HSDP placements, ``(Replicate(), Shard(0))``). Hybrid units shard over the ``"shard"`` dim's group
  and all-reduce gradient shards over the ``"replicate"`` dim's group.
- 1-D: sharded over the whole mesh, as FSDP2 does with a 1-D mesh. Hybrid units then behave like
  FULL_SHARD over the mesh's group (there is no replicate group). A 1-D mesh named ``"replicate"``
  says the opposite (pure replication) and is rejected: use ``NO_SHARD`` for that.

The mesh must cover every rank of the job exactly once (its size equals the world size) and use the
same process groups on every rank; anything else raises a ``ValueError`` before any collective.
As with ``groups=``, units whose strategy is not hybrid keep using the default group.
"""

from __future__ import annotations

import logging
from typing import Any

import torch.distributed as dist

from hybridshard import collectives as C
from hybridshard.topology.groups import MESH_DIM_NAMES

logger = logging.getLogger(__name__)

__all__ = ["pair_from_mesh"]

_HOW_TO_BUILD = (
    "build it with torch.distributed.device_mesh.init_device_mesh(device_type, (replicate_size, shard_size), "
    f"mesh_dim_names={MESH_DIM_NAMES!r}), or take hybridshard.init_groups().mesh"
)


def pair_from_mesh(mesh: Any) -> C.GroupPair:
    """The :class:`GroupPair` hybrid units use over ``mesh``; see [Note: meshes in]."""
    from torch.distributed.device_mesh import DeviceMesh

    if not isinstance(mesh, DeviceMesh):
        raise ValueError(f"mesh must be a torch.distributed.device_mesh.DeviceMesh; got {type(mesh).__name__}. {_HOW_TO_BUILD}")
    names = tuple(mesh.mesh_dim_names) if mesh.mesh_dim_names else None
    world = dist.get_world_size()
    if mesh.size() != world:
        raise ValueError(
            f"the mesh has shape {tuple(mesh.shape)} ({mesh.size()} ranks) but the job has {world} ranks; "
            f"the mesh must cover every rank once: {_HOW_TO_BUILD}"
        )
    if mesh.get_coordinate() is None:
        raise ValueError(f"rank {dist.get_rank()} is not in the mesh {mesh.mesh.tolist()}; {_HOW_TO_BUILD}")
    if mesh.ndim == 1:
        if names == ("replicate",):
            raise ValueError(
                "a 1-D mesh named ('replicate',) asks for pure replication, but a 1-D mesh means 'shard over it'; "
                "use strategy='NO_SHARD' for replication, or a 2-D mesh named "
                f"{MESH_DIM_NAMES!r} ({_HOW_TO_BUILD})"
            )
        shard = mesh.get_group(0)
        if shard is not dist.group.WORLD:  # a mesh over the whole job may reuse the default group
            C.name_group(shard, "shard")
        return C.GroupPair(
            shard=shard, replicate=None, shard_size=world, shard_rank=dist.get_rank(shard), replicate_size=1
        )
    if mesh.ndim != 2:
        raise ValueError(
            f"mesh must be 1-D (shard over it) or 2-D {MESH_DIM_NAMES!r}; got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} named {names}. Slice the data-parallel part first (mesh['replicate', 'shard']) "
            f"or {_HOW_TO_BUILD}"
        )
    if names != MESH_DIM_NAMES:
        raise ValueError(f"a 2-D mesh must have mesh_dim_names={MESH_DIM_NAMES!r}; got {names}. {_HOW_TO_BUILD}")
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    C.name_group(shard, "shard")
    C.name_group(replicate, "replicate")
    replicate_size, shard_size = (int(n) for n in mesh.shape)
    logger.debug("mesh %s: shard size %d, replicate size %d", mesh.mesh.tolist(), shard_size, replicate_size)
    return C.GroupPair(
        shard=shard,
        replicate=replicate,
        shard_size=shard_size,
        shard_rank=dist.get_rank(shard),
        replicate_size=replicate_size,
        replicate_rank=dist.get_rank(replicate),
    )
