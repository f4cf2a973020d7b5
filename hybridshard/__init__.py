"""hybridshard: hybrid sharded data parallel training on process groups built from the discovered
cluster topology.

Parameters, gradients and optimizer state are sharded inside a fast domain (normally one node) and
replicated across domains. The groups come from :func:`init_groups`, which probes every rank's node,
gathers the probes and plans the shard and replicate groups (see :mod:`topology`).
"""

# Groups (topology/groups.py)
from hybridshard.topology.groups import ShardGroups, init_groups

# The surface: shard() and its handle class, options, and the checkpoint and debug namespaces
from hybridshard.handle import HybridShardModule, shard
from hybridshard.options import CheckConfig, CommConfig, Compression, Executor, InitConfig
from hybridshard.runtime.setup.deferred_init import materialize
from hybridshard.runtime.optim.grad_scaler import ShardedGradScaler
from hybridshard.runtime.units.offload import CPUOffload
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.state.shapes import param_groups
from hybridshard import checkpoint, debug

# Fault-tolerant replicas on torchft (hybridshard/ft/; torchft is needed only to create the mode)
from hybridshard.ft.mode import FaultTolerance

# Aliases: every name exported before the surface above, the same objects (docs/api.md lists where each
# lives now); importable, out of __all__.
from hybridshard.runtime.trace.counters import count_collectives
from hybridshard.runtime.engine import no_sync
from hybridshard.runtime.optim.grad_norm import clip_grad_norm_
from hybridshard.runtime.trace.issue_order import record_issue_order
from hybridshard.runtime.units.layout import FlatLayout
from hybridshard.runtime.optim.replica_slices import gather_updated_params
from hybridshard.runtime.engine import comm_stats
from hybridshard.runtime.units.unit import ShardedState, TrainingState
from hybridshard.state.checkpoint import SaveResult, latest_checkpoint, load_checkpoint, save_checkpoint
from hybridshard.state.full import full_state_dict, load_full_state_dict
from hybridshard.state.optim import full_optim_state_dict, load_full_optim_state_dict
from hybridshard.state.pretrained_load import LoadResult, load_pretrained
from hybridshard.state.pretrained_save import save_pretrained
from hybridshard.state.replicas import ReplicaDivergence, check_replicas, maybe_check_replicas
from hybridshard.state.shapes import param_groups, param_shapes
from hybridshard.state.trust import UnsafeCheckpointError

__version__ = "0.1.0"

__all__ = [
    "shard",
    "HybridShardModule",
    "init_groups",
    "ShardGroups",
    "ShardingStrategy",
    "MixedPrecision",
    "CPUOffload",
    "CommConfig",
    "CheckConfig",
    "InitConfig",
    "Executor",
    "Compression",
    "ShardedGradScaler",
    "materialize",
    "param_groups",
    "FaultTolerance",
    "checkpoint",
    "debug",
]
