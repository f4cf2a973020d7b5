"""This rank's shard and replicate groups: the one type for them, and every way to get one.

:class:`ShardGroups` is the only groups type of the project. It comes from

- :func:`init_groups`: probe every rank, gather the cluster view, plan (a pure function, see
  :mod:`hybridshard.topology.planner`) and :func:`build_groups`;
- :meth:`ShardGroups.from_mesh`: a ``DeviceMesh`` as FSDP2 and torchtitan describe hybrid sharding;
- :meth:`ShardGroups.over_world`: the whole job as one shard group (FULL_SHARD, SHARD_GRAD_OP) or as
  one replicate group (NO_SHARD).

[Note: None means no group]
``shard`` or ``replicate`` is ``None`` when that dimension holds this rank alone: its size is 1 and
nothing is ever sent over it. ``None`` never stands for the whole job; the whole job is
``torch.distributed.group.WORLD``, passed explicitly. The collectives follow the same rule (see
:mod:`hybridshard.runtime.comm.collectives`), so a missed guard cannot turn into a collective over every rank.

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

[Note: meshes in]
FSDP2 and torchtitan users describe hybrid sharding with a ``DeviceMesh``: a 2-D mesh whose dim 0
replicates and dim 1 shards, built as ``init_device_mesh(device, (R, S),
mesh_dim_names=("replicate", "shard"))``. ``shard(..., mesh=...)`` accepts that mesh in place of
``groups=`` (a :class:`ShardGroups`, whose ``.mesh`` is such a mesh too):

- 2-D: the dims must be named ``("replicate", "shard")`` in that order (the order FSDP2 gives its
  HSDP placements, ``(Replicate(), Shard(0))``). Hybrid units shard over the ``"shard"`` dim's group
  and all-reduce gradient shards over the ``"replicate"`` dim's group.
- 1-D: sharded over the whole mesh, as FSDP2 does with a 1-D mesh. Hybrid units then behave like
  FULL_SHARD over the mesh's group (there is no replicate group). A 1-D mesh named ``"replicate"``
  says the opposite (pure replication) and is rejected: use ``NO_SHARD`` for that.

The mesh must cover every rank of the job exactly once (its size equals the world size) and use the
same process groups on every rank; anything else raises a ``ValueError`` before any collective.
"""

from __future__ import annotations

import logging
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, Sequence

import torch
import torch.distributed as dist

from hybridshard.topology.cluster import gather_cluster
from hybridshard.topology.planner import GroupPlan, plan_groups
from hybridshard.topology.rack_groups import RackGroups, plan_rack_groups
from hybridshard.topology.records import ClusterView, RankProbe
from hybridshard.topology.shard_hops import plan_shard_hops

if TYPE_CHECKING:
    from hybridshard.topology.nvml import NvmlSource

logger = logging.getLogger(__name__)

__all__ = [
    "MESH_DIM_NAMES", "ShardGroups", "build_groups", "collective_device", "group_name", "group_ranks", "init_groups", "local_device",
    "name_group",
]

MESH_DIM_NAMES = ("replicate", "shard")

_NAMES: "weakref.WeakKeyDictionary[dist.ProcessGroup, str]" = weakref.WeakKeyDictionary()


def name_group(group: dist.ProcessGroup, name: str) -> None:
    """Give ``group`` a name for counters, debug logs and fault messages ("shard", "replicate", "world")."""
    _NAMES[group] = name


def group_name(group: dist.ProcessGroup | None) -> str:
    """The name :func:`name_group` gave ``group``; ``"world"`` for the default group, ``"none"`` for no group."""
    if group is None:
        return "none"
    found = _NAMES.get(group)
    if found is not None:
        return found
    return "world" if group is dist.group.WORLD else f"group@{id(group):x}"


def group_ranks(group: dist.ProcessGroup | None) -> list[int]:
    """Global ranks of ``group``: this rank alone for ``None`` (no group), every rank for the world."""
    if group is None:
        return [dist.get_rank()]
    if group is dist.group.WORLD:
        return list(range(dist.get_world_size()))
    return list(dist.get_process_group_ranks(group))


def collective_device() -> torch.device:
    """The device the default group communicates from: the current GPU under NCCL, else the CPU."""
    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _size_and_rank(group: dist.ProcessGroup | None) -> tuple[int, int]:
    return (1, 0) if group is None else (dist.get_world_size(group), dist.get_rank(group))


@dataclass(frozen=True, eq=False)
class ShardGroups:
    """This rank's groups for one sharded model; see [Note: None means no group]."""

    shard: dist.ProcessGroup | None
    """The ranks this rank shards parameters with (one fast domain, or ``plan.shard_nodes`` whole nodes)."""
    replicate: dist.ProcessGroup | None
    """The ranks holding the same shard in other domains; gradient shards are all-reduced here."""
    mesh: Any = None
    """A 2-D ``DeviceMesh`` named ``("replicate", "shard")`` over the same groups, or ``None``."""
    plan: GroupPlan | None = None
    """The plan the groups were built from, when they came from :func:`init_groups`."""
    cluster: ClusterView | None = None
    """The cluster view the plan came from, when known."""
    device: torch.device | None = None
    """The device this rank computes on: its GPU as topology found it, else the CPU."""
    racks: Any = None
    """This rank's :class:`~hybridshard.topology.rack_groups.RackGroups` (the replicate reduction in two
    hops), when the plan's replicate groups span racks of equal size; else ``None``."""
    shard_hops: Any = None
    """This rank's shard group in two hops, inside its node then across nodes, as a
    :class:`~hybridshard.topology.rack_groups.RackGroups` (node = rack; see [Note: two hops over nodes]
    in :mod:`hybridshard.topology.shard_hops`), when the shard group spans nodes with more than one
    rank on each; else ``None``. Its ``replicate_rank`` is this rank's ``shard_rank``."""
    shard_size: int = field(init=False)
    replicate_size: int = field(init=False)
    shard_rank: int = field(init=False)
    replicate_rank: int = field(init=False)
    """This rank's index in the replicate group; replica 0 holds the copy that norms count."""

    def __post_init__(self) -> None:
        for kind in ("shard", "replicate"):
            size, rank = _size_and_rank(getattr(self, kind))
            object.__setattr__(self, f"{kind}_size", size)
            object.__setattr__(self, f"{kind}_rank", rank)

    @property
    def world_size(self) -> int:
        return self.shard_size * self.replicate_size

    @classmethod
    def over_world(cls, *, replicate: bool = False) -> "ShardGroups":
        """The whole job as the shard group (``replicate=False``) or as the replicate group."""
        world = dist.group.WORLD
        name_group(world, "world")
        return cls(shard=None, replicate=world) if replicate else cls(shard=world, replicate=None)

    @classmethod
    def from_mesh(cls, mesh: Any) -> "ShardGroups":
        """The groups of ``mesh``; see [Note: meshes in]."""
        return _from_mesh(mesh)


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
    # See [Note: network order] in planner.py: a group's rank follows its list, so an unsorted list is
    # created with sort_ranks=False, which split_group cannot honour.
    ordered = all(list(r) == sorted(r) for r in rank_lists)
    if backend is None and ordered and _split_capable(default_pg):
        mine = dist.split_group(split_ranks=[list(r) for r in rank_lists], timeout=timeout, group_desc=kind)
        logger.debug("created %d %s groups with split_group", len(rank_lists), kind)
    else:
        mine = None
        for i, ranks in enumerate(rank_lists):
            pg = dist.new_group(list(ranks), backend=backend, timeout=timeout, group_desc=f"{kind}{i}",
                                sort_ranks=ordered)
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
    name_group(shard, "shard")
    name_group(replicate, "replicate")
    racks = _build_racks(plan, backend)
    shard_hops = _build_shard_hops(plan, backend)
    mesh = _build_mesh(plan, shard, replicate)
    logger.info(
        "rank %d: shard group %s, replicate group %s",
        dist.get_rank(),
        plan.shard_group_of(dist.get_rank()),
        plan.replicate_group_of(dist.get_rank()),
    )
    groups = ShardGroups(shard=shard, replicate=replicate, mesh=mesh, plan=plan, cluster=cluster, device=device,
                         racks=racks, shard_hops=shard_hops)
    if shard_hops is not None and shard_hops.replicate_rank != groups.shard_rank:
        raise RuntimeError(f"rank {dist.get_rank()}: two-hop place {shard_hops.replicate_rank} != shard rank "
                           f"{groups.shard_rank}; the shard group was not created in the plan's member order")
    return groups


def _build_racks(plan: GroupPlan, backend: str | None):
    """The two-hop groups (see [Note: two hops across racks] in rack_groups.py), or ``None``."""
    rack_plan, why = plan_rack_groups(plan)
    if rack_plan is None:
        logger.debug("no replicate reduction in two hops: %s", why)
        return None
    rack, across = _named_groups({"rack": rack_plan.rack_groups, "across_racks": rack_plan.across_groups}, backend)
    return RackGroups.find(rack_plan, dist.get_rank(), rack, across)


def _named_groups(lists: dict[str, Sequence[Sequence[int]]], backend: str | None) -> list[dist.ProcessGroup]:
    """Create each kind's groups in turn; this rank's group of each kind, named after the kind."""
    mine = []
    for kind, rank_lists in lists.items():
        mine.append(_create(rank_lists, kind, backend))
        name_group(mine[-1], kind)
    return mine


def _build_shard_hops(plan: GroupPlan, backend: str | None, names: tuple[str, str] = ("shard_node", "shard_across")):
    """The shard group's two hops (see [Note: two hops over nodes] in shard_hops.py), or ``None``;
    ``names``: of the groups inside the node and across nodes."""
    hop_plan, why = plan_shard_hops(plan)
    if hop_plan is None:
        logger.debug("no shard collectives in two hops: %s", why)
        return None
    node, across = _named_groups(dict(zip(names, (hop_plan.node_groups, hop_plan.across_groups))), backend)
    return hop_plan.groups_of(dist.get_rank(), node, across)


# -- from discovery -----------------------------------------------------------------------------


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


def init_groups(
    *, shard_size: int | None = None, domain: str = "node", nvml: "NvmlSource | None" = None
) -> ShardGroups:
    """Probe every rank, gather the cluster view, plan the groups and build them.

    Collective over the default process group: every rank must call it with the same arguments.
    Raises ``ValueError`` (on every rank alike, since every rank plans from the same view) when the
    cluster cannot be tiled as asked. ``nvml`` answers the GPU queries in place of the real NVML
    (a :class:`~hybridshard.topology.nvml_recorded.FakeNvml` replaying a recorded machine); each rank
    still takes its GPU from ``LOCAL_RANK`` and ``CUDA_VISIBLE_DEVICES`` as
    :func:`~hybridshard.topology.probe.probe_rank` describes.
    """
    if not dist.is_initialized():
        raise RuntimeError(
            "init_groups needs an initialised default process group: call "
            "torch.distributed.init_process_group() first (under torchrun or `hybridshard launch`)"
        )
    from hybridshard.topology.probe import probe_rank  # psutil and NVML only when discovering

    probe = probe_rank(rank=dist.get_rank(), world_size=dist.get_world_size(), nvml=nvml)
    device = local_device(probe)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    cluster = gather_cluster(probe)
    plan = plan_groups(cluster, shard_size=shard_size, domain=domain)
    for note in plan.notes:
        if dist.get_rank() == 0:
            logger.warning("group plan: %s", note)
    return build_groups(plan, cluster=cluster, device=device)


# -- from a DeviceMesh ---------------------------------------------------------------------------

_HOW_TO_BUILD = (
    "build it with torch.distributed.device_mesh.init_device_mesh(device_type, (replicate_size, shard_size), "
    f"mesh_dim_names={MESH_DIM_NAMES!r}), or take hybridshard.init_groups().mesh"
)


def _from_mesh(mesh: Any) -> ShardGroups:
    """See [Note: meshes in]."""
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
            name_group(shard, "shard")
        return ShardGroups(shard=shard, replicate=None, mesh=mesh)
    if mesh.ndim != 2:
        raise ValueError(
            f"mesh must be 1-D (shard over it) or 2-D {MESH_DIM_NAMES!r}; got a {mesh.ndim}-D mesh of shape "
            f"{tuple(mesh.shape)} named {names}. Slice the data-parallel part first (mesh['replicate', 'shard']) "
            f"or {_HOW_TO_BUILD}"
        )
    if names != MESH_DIM_NAMES:
        raise ValueError(f"a 2-D mesh must have mesh_dim_names={MESH_DIM_NAMES!r}; got {names}. {_HOW_TO_BUILD}")
    shard, replicate = mesh.get_group("shard"), mesh.get_group("replicate")
    name_group(shard, "shard")
    name_group(replicate, "replicate")
    logger.debug("mesh %s: shard size %d, replicate size %d", mesh.mesh.tolist(), *reversed(tuple(mesh.shape)))
    return ShardGroups(shard=shard, replicate=replicate, mesh=mesh)
