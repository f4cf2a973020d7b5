"""Sizing: per-GPU memory and per-step communication of each strategy and shard size (pure math).

No process group, no tensor: a model described by its parameter counts and dtypes, a cluster by its
node sizes, memory and link bandwidths. ``hybridshard plan --model-params`` renders the result;
docs/planning.md derives every formula.

[Note: ring model]
Bytes are counted per rank per training step (one forward and one backward, no ``no_sync``) as a
ring algorithm moves them: an all-gather or reduce-scatter of ``N`` elements of ``b`` bytes over a
group of ``n`` ranks sends ``(n-1)/n * N * b`` bytes from each rank, an all-reduce twice that. The
runtime gathers each ZeRO-3 unit twice per step (forward, then again for backward) except the root
unit, which stays gathered from forward into backward (gathered once, like every ZeRO-2 unit).

[Note: which link a group uses]
A group whose ranks all sit on one node runs on the intra-node link (NVLink). A group spanning
nodes is a ring with some edges on the network; every byte passes every edge, so the ring moves at
the speed of its slowest edge and its whole per-rank traffic is charged to the inter-node link,
even when most of its edges are NVLink. That is why FULL_SHARD over several nodes is slow: all of
its gathers and reduce-scatters run at network speed. Hybrid strategies keep the shard group inside
a node and send only the gradient shard's all-reduce over the network. Collectives are charged one
after another (the runtime issues them on one stream), so step time is the sum of both links' times.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Sequence

from hybridshard.comm_bytes import ring_factor
from hybridshard.runtime.units.strategy import ShardingStrategy

__all__ = [
    "DTYPE_BYTES",
    "ClusterSpec",
    "Estimate",
    "LinkClass",
    "MemoryEstimate",
    "ModelSpec",
    "Optimizer",
    "Recommendation",
    "estimate",
    "estimate_all",
    "recommend",
    "shard_sizes",
    "step_collectives",
]

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
"""Bytes per element of the dtypes the planner knows (``torch.float32``, ``bfloat16``, ``float16``)."""


class Optimizer(enum.Enum):
    """Optimizers by the state they keep per parameter element (in the master dtype)."""

    ADAMW = "adamw"
    ADAM = "adam"
    SGD = "sgd"
    """With momentum (one buffer); plain SGD keeps nothing: use ``NONE`` for it."""
    ADAGRAD = "adagrad"
    RMSPROP = "rmsprop"
    NONE = "none"

    @property
    def states_per_param(self) -> int:
        return {"adamw": 2, "adam": 2, "sgd": 1, "adagrad": 1, "rmsprop": 1, "none": 0}[self.value]

    @property
    def step_temporaries(self) -> int:
        """Parameter-sized temporaries torch's foreach implementation allocates in ``step()``."""
        return {"adamw": 1, "adam": 1, "sgd": 0, "adagrad": 1, "rmsprop": 1, "none": 0}[self.value]


class LinkClass(enum.Enum):
    INTRA_NODE = "intra_node"
    INTER_NODE = "inter_node"


def _check_dtype(name: str, value: str) -> None:
    if value not in DTYPE_BYTES:
        raise ValueError(f"{name} must be one of {', '.join(DTYPE_BYTES)}; got {value!r}")


@dataclass(frozen=True)
class ModelSpec:
    """What the planner needs to know about a model."""

    num_params: int
    """Distinct parameter elements (tied ones once), frozen ones included: they are sharded too."""
    unit_params: int
    """Parameters of the largest wrapped unit (one transformer block, for ``wrap={Block}``)."""
    root_params: int = 0
    """Parameters the root unit holds directly (those outside every wrapped unit)."""
    param_dtype: str = "bf16"
    """Dtype parameters are gathered and computed in (``MixedPrecision.param_dtype``)."""
    reduce_dtype: str = "fp32"
    """Dtype gradients are reduced in (``MixedPrecision.reduce_dtype``)."""
    master_dtype: str = "fp32"
    """Dtype of the sharded parameters the optimizer steps, of gradient shards and optimizer state."""
    optimizer: Optimizer = Optimizer.ADAMW

    def __post_init__(self) -> None:
        if not isinstance(self.num_params, int) or self.num_params < 1:
            raise ValueError(f"num_params must be a positive integer (e.g. 7e9 -> 7000000000); got {self.num_params!r}")
        if not 1 <= self.unit_params <= self.num_params:
            raise ValueError(
                f"unit_params must be between 1 and num_params ({self.num_params}); got {self.unit_params}. "
                "Pass the parameters of the largest wrapped unit, or the number of layers"
            )
        if not 0 <= self.root_params <= self.num_params:
            raise ValueError(f"root_params must be between 0 and num_params ({self.num_params}); got {self.root_params}")
        for name in ("param_dtype", "reduce_dtype", "master_dtype"):
            _check_dtype(name, getattr(self, name))
        if not isinstance(self.optimizer, Optimizer):
            raise ValueError(f"optimizer must be a hybridshard.estimates.sizing.Optimizer; got {self.optimizer!r}")

    @property
    def b_param(self) -> int:
        return DTYPE_BYTES[self.param_dtype]

    @property
    def b_reduce(self) -> int:
        return DTYPE_BYTES[self.reduce_dtype]

    @property
    def b_master(self) -> int:
        return DTYPE_BYTES[self.master_dtype]


@dataclass(frozen=True)
class ClusterSpec:
    """Node sizes, per-GPU memory and per-GPU link bandwidths (one direction, gigabits per second)."""

    node_sizes: tuple[int, ...]
    """Ranks (= GPUs) on each node."""
    gpu_memory_bytes: int
    intra_node_gbps: float = 3600.0
    """NVLink bandwidth per GPU and direction: 450 GB/s = 3600 Gb/s on H100 SXM."""
    inter_node_gbps: float = 200.0
    """Network bandwidth per GPU and direction (one 200 Gb/s NIC per GPU)."""

    def __post_init__(self) -> None:
        if not self.node_sizes or min(self.node_sizes) < 1:
            raise ValueError(f"node_sizes must be one or more positive rank counts; got {self.node_sizes}")
        if self.gpu_memory_bytes <= 0:
            raise ValueError(f"gpu_memory_bytes must be positive (e.g. 80GB); got {self.gpu_memory_bytes}")
        for name in ("intra_node_gbps", "inter_node_gbps"):
            value = getattr(self, name)
            if not (value > 0 and math.isfinite(value)):
                raise ValueError(f"{name} must be a positive number of gigabits per second; got {value!r}")

    @property
    def world_size(self) -> int:
        return sum(self.node_sizes)

    @property
    def num_nodes(self) -> int:
        return len(self.node_sizes)

    def gbps(self, link: LinkClass) -> float:
        return self.intra_node_gbps if link is LinkClass.INTRA_NODE else self.inter_node_gbps


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes one GPU holds for the model (activations, workspace and the CUDA context not included)."""

    params: int
    """The master shard."""
    grads: int
    """The gradient shard (master dtype)."""
    optimizer: int
    gathered: int
    """Unsharded buffers and gradients alive at the peak: what stays gathered, the ``prefetch + 1``
    ZeRO-3 units gathered, the unit gradient in flight (less the gradient shards for ZeRO-2, whose
    peak comes before they exist)."""
    step_temp: int = 0
    """The optimizer step's own temporary (foreach Adam's square root of the second moment, one per
    parameter of the slice): the step's peak, when it exceeds the backward's ``gathered``."""
    root_backward: int = 0
    """ZeRO-3: the root's backward, last in the step (its kept parameters, its gradient, the last unit's
    in flight): the peak when the root (embedding, head) outweighs a few units, as with a large vocabulary."""

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer + max(self.gathered, self.root_backward, self.step_temp)


@dataclass(frozen=True)
class Estimate:
    """One strategy at one shard size."""

    strategy: ShardingStrategy
    shard_size: int
    replicate_size: int
    memory: MemoryEstimate
    collectives: dict[tuple[str, str], float]
    """Ring bytes per rank per step, by ``(kind, group)`` as ``count_collectives`` names them."""
    bytes_by_link: dict[LinkClass, float]
    seconds_by_link: dict[LinkClass, float]
    fits: bool
    notes: tuple[str, ...] = field(default=())
    shard_optimizer: bool = False
    """``shard(shard_optimizer_across_replicas=True)``: optimizer state and gradient over shard x replicate."""

    @property
    def label(self) -> str:
        """The strategy's name, with ``+optim`` when the optimizer is sharded across replicas."""
        return self.strategy.name + ("+optim" if self.shard_optimizer else "")

    @property
    def comm_seconds(self) -> float:
        return sum(self.seconds_by_link.values())


@dataclass(frozen=True)
class Recommendation:
    choice: Estimate | None
    reason: str


def shard_sizes(cluster: ClusterSpec) -> list[int]:
    """Shard sizes a hybrid strategy can use: the divisors (> 1) of every node's size.

    Shard groups stay inside a node (see [Note: the hybrid grid] in the group planner), so a size
    must tile every node. 1 is left out: a shard group of one is NO_SHARD with extra steps.
    """
    common = math.gcd(*cluster.node_sizes)
    return [s for s in range(2, common + 1) if common % s == 0]


def _groups(strategy: ShardingStrategy, cluster: ClusterSpec, shard_size: int) -> tuple[int, int]:
    world = cluster.world_size
    if strategy is ShardingStrategy.NO_SHARD:
        return 1, world
    if not strategy.is_hybrid:
        return world, 1
    return shard_size, world // shard_size


def step_collectives(
    strategy: ShardingStrategy, shard_size: int, replicate_size: int, *, model: ModelSpec,
    shard_optimizer: bool = False,
) -> dict[tuple[str, str], float]:
    """Ring bytes per rank per step by ``(kind, group)``; see [Note: ring model].

    Groups are named as the runtime names them: ``"shard"``/``"replicate"`` for hybrid strategies,
    ``"world"`` for the others. Collectives over one rank move nothing and are left out. With
    ``shard_optimizer`` (hybrid only) the replicate all-reduce is a reduce-scatter of the gradient
    shard plus, after the step, an all-gather of the updated parameters in the compute dtype.
    """
    n, root = model.num_params, model.root_params
    s, r = shard_size, replicate_size
    gathered = 2 * n - root if strategy.reshard_after_forward else n  # elements all-gathered per step
    out: dict[tuple[str, str], float] = {}
    if strategy is ShardingStrategy.NO_SHARD:
        if r > 1:
            out[("all_reduce", "world")] = ring_factor("all_reduce", r) * n * model.b_reduce
        return out
    shard_group = "shard" if strategy.is_hybrid else "world"
    if s > 1:
        out[("all_gather", shard_group)] = ring_factor("all_gather", s) * gathered * model.b_param
        out[("reduce_scatter", shard_group)] = ring_factor("reduce_scatter", s) * n * model.b_reduce
    if strategy.is_hybrid and r > 1 and shard_optimizer:
        out[("reduce_scatter", "replicate")] = ring_factor("reduce_scatter", r) * (n / s) * model.b_reduce
        out[("all_gather", "replicate")] = ring_factor("all_gather", r) * (n / s) * model.b_param
    elif strategy.is_hybrid and r > 1:
        out[("all_reduce", "replicate")] = ring_factor("all_reduce", r) * (n / s) * model.b_reduce
    return out


def _link_of(group: str, cluster: ClusterSpec) -> LinkClass:
    """See [Note: which link a group uses]."""
    if cluster.num_nodes == 1 or group == "shard":  # a hybrid shard group lies inside one node
        return LinkClass.INTRA_NODE
    return LinkClass.INTER_NODE  # the world, or a replicate group (a member in every shard group, so on every node)


def memory(strategy: ShardingStrategy, shard_size: int, *, model: ModelSpec, prefetch: int = 1,
           overlap_grads: bool = True, replicate_size: int = 1, shard_optimizer: bool = False,
           foreach: bool = True) -> MemoryEstimate:
    """Per-GPU bytes at the step's peak (in backward); docs/planning.md explains each term.

    ``prefetch`` and ``overlap_grads`` are ``shard()``'s: ZeRO-3 with prefetch ``d`` keeps up to
    ``d + 1`` units gathered, and an overlapped reduction keeps the previous unit's gradient alive
    while the next one is summed. ``shard_optimizer`` (with ``replicate_size``): gradients, optimizer
    state and the master are this rank's ``1 / replicate_size`` slice of the shard; under mixed
    precision the shard is kept in the compute dtype besides. ``foreach``: the optimizer steps every
    parameter at once (torch's default on CUDA), with a temporary the size of the slice; torch's
    per-parameter loop (its default on CPU) allocates one parameter's at a time, left out.
    """
    shard_numel, root_backward = -(-model.num_params // shard_size), 0
    slice_numel = -(-shard_numel // replicate_size) if shard_optimizer else shard_numel
    b_p, b_m, b_r, unit = model.b_param, model.b_master, model.b_reduce, model.unit_params
    # The unit's gradient while autograd builds the flat gradient: every parameter's gradient (one
    # unit in all) and their concatenation (see [Note: one split, one gradient buffer]). It arrives
    # in the compute dtype; a different reduce dtype adds a cast copy.
    unit_grad = unit * b_p * 2 + (unit * b_r if model.reduce_dtype != model.param_dtype else 0)
    if overlap_grads and shard_size > 1:
        unit_grad += unit * b_r  # the previous unit's gradient, kept until its reduce-scatter is done
    grads = slice_numel * b_m
    if shard_size == 1:
        # The gathered buffer is the master itself unless it is computed in another dtype, and
        # then every unit keeps its copy from forward until its backward.
        kept = 0 if model.param_dtype == model.master_dtype else model.num_params * b_p
        working = unit_grad
    elif strategy.reshard_after_forward:
        kept = model.root_params * b_p
        # At the peak (a unit's backward, ``prefetch`` more gathered) those units lack their gradient shard.
        gathered_units = min(prefetch + 1, max(1, (model.num_params - model.root_params) // unit))
        working = gathered_units * (unit * b_p - -(-unit // shard_size) * b_m) + unit_grad
        # The root's gradients and their concatenation, then the concatenation and its reduce-dtype copy.
        root = model.root_params
        root_grad = root * b_p + max(root * b_p, root * b_r if model.reduce_dtype != model.param_dtype else 0)
        root_backward = kept + root_grad + (unit * b_r if overlap_grads else 0)
    else:
        # ZeRO-2: every unit stays gathered from forward into backward, so the peak is the first
        # unit's backward, before any gradient shard exists: the grads term is not there yet.
        kept = model.num_params * b_p - grads
        working = unit_grad
    if slice_numel == shard_numel or b_p == b_m:
        params = shard_numel * b_m  # the optimizer's slice is a view of the master shard
    else:
        params = slice_numel * b_m + shard_numel * b_p  # the master slice, and the shard in the compute dtype
    return MemoryEstimate(
        params=params,
        grads=grads,
        optimizer=model.optimizer.states_per_param * slice_numel * b_m,
        gathered=kept + working,
        step_temp=model.optimizer.step_temporaries * slice_numel * b_m if foreach else 0,
        root_backward=root_backward,
    )


def estimate(strategy: ShardingStrategy, shard_size: int, *, model: ModelSpec, cluster: ClusterSpec,
             prefetch: int = 1, overlap_grads: bool = True, shard_optimizer: bool = False) -> Estimate:
    """Memory and communication of ``strategy`` with ``shard_size`` (ignored unless hybrid);
    ``shard_optimizer``: ``shard_optimizer_across_replicas=True`` (hybrid strategies only)."""
    if shard_optimizer and not strategy.is_hybrid:
        raise ValueError(f"shard_optimizer expects a hybrid strategy, found {strategy.name}; drop it or pick HYBRID_SHARD")
    s, r = _groups(strategy, cluster, shard_size)
    if s * r != cluster.world_size:
        raise ValueError(
            f"shard size {s} does not divide the world size {cluster.world_size}; pick one of {shard_sizes(cluster)}"
        )
    collectives = step_collectives(strategy, s, r, model=model, shard_optimizer=shard_optimizer)
    by_link = {LinkClass.INTRA_NODE: 0.0, LinkClass.INTER_NODE: 0.0}
    for (_, group), nbytes in collectives.items():
        by_link[_link_of(group, cluster)] += nbytes
    seconds = {link: nbytes * 8 / (cluster.gbps(link) * 1e9) for link, nbytes in by_link.items()}
    mem = memory(strategy, s, model=model, prefetch=prefetch, overlap_grads=overlap_grads, replicate_size=r,
                 shard_optimizer=shard_optimizer)
    notes = []
    if not strategy.is_hybrid and strategy is not ShardingStrategy.NO_SHARD and cluster.num_nodes > 1:
        spans = f"its shard group spans {cluster.num_nodes} nodes"
        notes.append(f"{spans}: its gathers and reduce-scatters run at inter-node speed")
    if strategy.is_hybrid and s < min(cluster.node_sizes):
        notes.append(f"{min(cluster.node_sizes) // s} shard groups per node: the replicate ring also has NVLink edges")
    if strategy.is_hybrid and r > 1:
        notes.append(f"{r} replicas: with hybridshard.FaultTolerance a lost replica group costs a heartbeat, "
                     "not a restart (docs/fault-tolerance.md)")
    return Estimate(
        strategy=strategy,
        shard_size=s,
        replicate_size=r,
        memory=mem,
        collectives=collectives,
        bytes_by_link=by_link,
        seconds_by_link=seconds,
        fits=mem.total <= cluster.gpu_memory_bytes,
        notes=tuple(notes),
        shard_optimizer=shard_optimizer,
    )


def estimate_all(
    *, model: ModelSpec, cluster: ClusterSpec, hybrid_shard_sizes: Sequence[int] | None = None
) -> list[Estimate]:
    """Every strategy, and every hybrid strategy at every shard size that tiles the nodes, also with
    the optimizer sharded across replicas where there is more than one replica."""
    sizes = list(hybrid_shard_sizes) if hybrid_shard_sizes is not None else shard_sizes(cluster)
    world_sharded = (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP)
    out = [estimate(s, cluster.world_size, model=model, cluster=cluster) for s in world_sharded]
    out.append(estimate(ShardingStrategy.NO_SHARD, 1, model=model, cluster=cluster))
    for strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2):
        out += [estimate(strategy, s, model=model, cluster=cluster) for s in sizes]
    out += [estimate(ShardingStrategy.HYBRID_SHARD, s, model=model, cluster=cluster, shard_optimizer=True)
            for s in sizes if cluster.world_size // s > 1]
    return out


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.1f} GB"


def recommend(estimates: Sequence[Estimate], *, cluster: ClusterSpec) -> Recommendation:
    """The fitting option with the least communication time; ties (within 1%) go to less memory."""
    fitting = [e for e in estimates if e.fits]
    if not fitting:
        smallest = min(estimates, key=lambda e: e.memory.total)
        return Recommendation(
            None,
            f"nothing fits in {_gb(cluster.gpu_memory_bytes)} per GPU: the smallest option, {_label(smallest)}, "
            f"needs {_gb(smallest.memory.total)}. Add GPUs, use an optimizer with less state, or GPUs with more memory",
        )
    fastest = min(e.comm_seconds for e in fitting)
    near = [e for e in fitting if e.comm_seconds <= fastest * 1.01 + 1e-12]
    best = min(near, key=lambda e: (e.memory.total, e.comm_seconds))
    others = sorted((e for e in fitting if e is not best), key=lambda e: e.comm_seconds)
    runner_up = f"; next: {_label(others[0])} at {others[0].comm_seconds:.3g} s" if others else ""
    return Recommendation(
        best,
        f"fits ({_gb(best.memory.total)} of {_gb(cluster.gpu_memory_bytes)} before activations) with the least "
        f"communication per step: {best.comm_seconds:.3g} s at the given bandwidths{runner_up}",
    )


def _label(e: Estimate) -> str:
    return f"{e.label} (shard size {e.shard_size})"
