"""What the Lightning ``Trainer`` and Fabric strategies share: their hybridshard settings, and one process
per device over the default process group (they derive from different ``ParallelStrategy`` classes
with the same attributes)."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard.integrations.common import require

require("lightning", "lightning")
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout  # noqa: E402
from lightning.fabric.utilities.distributed import _init_dist_connection, _sync_ddp_if_available  # noqa: E402


class LightningStrategyBase:
    """Settings, devices, ranks and the process group of a strategy, as Lightning's DDP strategies set them up.

    Mixed in before a Lightning ``ParallelStrategy`` (``Trainer`` or Fabric), which supplies
    ``parallel_devices``, ``cluster_environment``, ``local_rank``, ``node_rank``, ``global_rank`` and
    ``num_nodes``. Keyword arguments: ``sharding_strategy`` (the name ``FSDPStrategy`` uses), ``wrap``,
    ``groups`` and ``shard_kwargs`` go to :func:`hybridshard.shard` as ``strategy``, ``wrap``, ``groups``
    and its other arguments (``wrap=None``: the ``_no_split_modules`` classes of the Hugging Face models
    inside the module, else only the root unit; ``groups=None``: :func:`hybridshard.init_groups` for the
    hybrid strategies); ``process_group_backend`` and ``timeout`` are used when the strategy creates the
    process group; the rest (``accelerator``, ``parallel_devices``, ``cluster_environment``,
    ``checkpoint_io``, and the precision plugin) are the ``ParallelStrategy``'s."""

    parallel_devices: list[torch.device] | None
    cluster_environment: Any
    num_nodes: int

    def __init__(
        self,
        *,
        sharding_strategy: hs.ShardingStrategy | str = hs.ShardingStrategy.HYBRID_SHARD,
        wrap: Any = None,
        groups: Any = None,
        shard_kwargs: dict[str, Any] | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        **strategy_kwargs: Any,
    ) -> None:
        super().__init__(**strategy_kwargs)  # type: ignore[call-arg]
        self.sharding_strategy = hs.ShardingStrategy.parse(sharding_strategy)
        self.wrap, self.groups, self.shard_kwargs = wrap, groups, dict(shard_kwargs or {})
        self._process_group_backend = process_group_backend
        self._timeout = timeout

    @property
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]  # type: ignore[attr-defined]

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": self.num_nodes * self.num_processes, "rank": self.global_rank}  # type: ignore[attr-defined]

    def setup_environment(self) -> None:
        super().setup_environment()  # type: ignore[misc]
        env = self.cluster_environment
        assert env is not None
        env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)  # type: ignore[attr-defined]
        env.set_world_size(self.num_nodes * self.num_processes)
        backend = self._process_group_backend or ("nccl" if self.root_device.type == "cuda" else "gloo")
        _init_dist_connection(env, backend, timeout=self._timeout)  # no-op when the group exists

    def launcher_needed(self) -> bool:
        """Whether the strategy starts the other processes itself (not under torchrun, SLURM ...)."""
        assert self.cluster_environment is not None
        return not self.cluster_environment.creates_processes_externally

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if dist.is_initialized():
            dist.barrier()

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not dist.is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Lightning ``Trainer``'s name; Fabric calls it ``all_reduce``."""
        return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op) if isinstance(tensor, torch.Tensor) else tensor

    all_reduce = reduce
