"""hybridshard: hybrid sharded data parallel training on process groups built from the discovered
cluster topology.

Parameters, gradients and optimizer state are sharded inside a fast domain (normally one node) and
replicated across domains. The groups come from :func:`init_groups`, which probes every rank's node,
gathers the probes and plans the shard and replicate groups (see :mod:`topology`).
"""

# Groups (topology/groups.py)
from hybridshard.topology.groups import ShardGroups, init_groups

# The runtime (hybridshard/runtime/)
from hybridshard.runtime.engine import no_sync
from hybridshard.runtime.optim.grad_norm import clip_grad_norm_
from hybridshard.runtime.optim.grad_scaler import ShardedGradScaler
from hybridshard.runtime.optim.replica_slices import gather_updated_params
from hybridshard.runtime.setup.api import shard
from hybridshard.runtime.setup.deferred_init import materialize
from hybridshard.runtime.engine import comm_stats
from hybridshard.runtime.trace.counters import count_collectives
from hybridshard.runtime.trace.issue_order import record_issue_order
from hybridshard.runtime.units.layout import FlatLayout
from hybridshard.runtime.units.offload import CPUOffload
from hybridshard.runtime.units.strategy import MixedPrecision, ShardingStrategy
from hybridshard.runtime.units.unit import ShardedState, TrainingState

# State in and out (hybridshard/state/)
from hybridshard.state.checkpoint import SaveResult, latest_checkpoint, load_checkpoint, save_checkpoint
from hybridshard.state.full import full_state_dict, load_full_state_dict
from hybridshard.state.optim import full_optim_state_dict, load_full_optim_state_dict
from hybridshard.state.pretrained_load import LoadResult, load_pretrained
from hybridshard.state.pretrained_save import save_pretrained
from hybridshard.state.replicas import ReplicaDivergence, check_replicas, maybe_check_replicas
from hybridshard.state.shapes import param_groups, param_shapes
from hybridshard.state.trust import UnsafeCheckpointError

# Fault-tolerant replicas on torchft (hybridshard/ft/; torchft is needed only to create the mode)
from hybridshard.ft.mode import FaultTolerance

__version__ = "0.1.0"

__all__ = [
    "CPUOffload",
    "FlatLayout",
    "MixedPrecision",
    "ShardedGradScaler",
    "ShardedState",
    "ShardingStrategy",
    "TrainingState",
    "LoadResult",
    "ReplicaDivergence",
    "SaveResult",
    "UnsafeCheckpointError",
    "check_replicas",
    "full_optim_state_dict",
    "latest_checkpoint",
    "load_checkpoint",
    "load_full_optim_state_dict",
    "load_pretrained",
    "materialize",
    "param_groups",
    "param_shapes",
    "save_pretrained",
    "maybe_check_replicas",
    "save_checkpoint",
    "clip_grad_norm_",
    "comm_stats",
    "count_collectives",
    "FaultTolerance",
    "full_state_dict",
    "gather_updated_params",
    "load_full_state_dict",
    "no_sync",
    "record_issue_order",
    "shard",
    "ShardGroups",
    "init_groups",
]
