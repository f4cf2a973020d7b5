"""Options of :func:`hybridshard.shard` as enums and small frozen config records.

Each enum is a ``str`` enum, so ``Executor.THREADS == "threads"`` and the strings keep working; a
string that names no member raises a ``ValueError`` whose first line names what was expected, what
was found and the fix. The three config records group the keywords of ``shard`` that belong
together; each old keyword of ``shard`` is a field of the same name (see docs/api.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, fields
from typing import Any, Callable, Mapping

import torch.nn as nn

__all__ = ["CheckConfig", "CommConfig", "Compression", "Executor", "InitConfig", "parse_choice", "record_keywords",
           "split_keywords"]


class Executor(str, enum.Enum):
    """Who issues a model's collectives; see :mod:`hybridshard.runtime.comm.executors.select`."""

    AUTO = "auto"  # streams on CUDA, the communication thread on CPU
    THREADS = "threads"  # a communication thread (CPU tensors, gloo)
    STREAMS = "streams"  # one issuing thread and side streams (no-op streams on CPU)
    EMULATE = "emulate"  # the stream executor on the emulated GPU (CPU tensors, NCCL's rules)


class Compression(str, enum.Enum):
    """How hybrid units' gradients cross the replicate group; see :mod:`hybridshard.runtime.grads.compression`."""

    NONE = "none"  # exact all-reduce in the reduce dtype
    BF16 = "bf16"  # half the inter-node bytes, with error feedback
    INT8 = "int8"  # a quarter of the bytes (block-scaled), with error feedback


def parse_choice(enum_type: type[enum.Enum], value: Any, option: str) -> Any:
    """``value`` as a member of ``enum_type`` (a member, or its value in any case)."""
    if isinstance(value, enum_type):
        return value
    if isinstance(value, str):
        for member in enum_type:
            if member.value == value.lower():
                return member
    choices = ", ".join(repr(m.value) for m in enum_type)
    first = next(iter(enum_type))
    raise ValueError(
        f"{option} expects hybridshard.{enum_type.__name__} or one of {choices}, found {value!r}; "
        f"pass e.g. {option}=hybridshard.{enum_type.__name__}.{first.name} or {option}={first.value!r}"
    )


def _expect_bool(owner: str, name: str, value: Any, *, optional: bool = False) -> None:
    if isinstance(value, bool) or (optional and value is None):
        return
    allowed = "True, False or None" if optional else "True or False"
    raise ValueError(f"{owner}.{name} expects {allowed}, found {value!r}; pass {name}=True or {name}=False")


@dataclass(frozen=True)
class CommConfig:
    """How a sharded model communicates (results are the same for every choice but compression)."""

    prefetch: int = 1
    """Units gathered ahead of the one computing, in forward and backward (0: none)."""
    overlap_grads: bool = True
    """Leave gradient collectives running while backward goes on."""
    replicate_compression: Compression | str | None = None
    """Quantize hybrid units' all-reduce across the replicate group (``None`` or ``"none"``: exact)."""
    executor: Executor | str | None = None
    """Who issues the collectives; ``None`` reads ``HYBRIDSHARD_EXECUTOR``, else ``"auto"``."""
    rack_reduce: bool | None = None
    """Reduce across replicas in two hops, inside each rack then across racks (``True``), flat
    (``False``), or as the cost model predicts faster for the groups' racks and links (``None``)."""
    two_hop: bool | None = None
    """Gather and reduce-scatter a shard group over several nodes in two hops, across nodes and inside
    each (``True``), flat over the group (``False``), or whenever it has more than one rank per node (``None``)."""
    reshard_after_forward: str | None = None
    """``"node"``: a ZeRO-3 unit over several nodes keeps its node-local secondary shard (1/g of it)
    from forward to backward, so backward's all-gather crosses no node; ``None``: as its strategy says."""

    def __post_init__(self) -> None:
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(
                f"CommConfig.prefetch expects a count of units >= 0, found {self.prefetch!r}; pass prefetch=1 "
                "(the default) or prefetch=0 to gather each unit only when it computes"
            )
        _expect_bool("CommConfig", "overlap_grads", self.overlap_grads)
        _expect_bool("CommConfig", "rack_reduce", self.rack_reduce, optional=True)
        _expect_bool("CommConfig", "two_hop", self.two_hop, optional=True)
        if self.reshard_after_forward not in (None, "node"):
            raise ValueError(
                f"CommConfig.reshard_after_forward expects None or 'node', found {self.reshard_after_forward!r}; pass "
                "reshard_after_forward='node' to keep a node-local secondary shard, or leave it to the strategy"
            )
        if self.replicate_compression is not None:
            object.__setattr__(self, "replicate_compression",
                               parse_choice(Compression, self.replicate_compression, "replicate_compression"))
        if self.executor is not None:
            object.__setattr__(self, "executor", parse_choice(Executor, self.executor, "executor"))


@dataclass(frozen=True)
class CheckConfig:
    """The checks that ranks agree, which turn a mismatch into a ``ValueError`` instead of a hang."""

    check_steps: bool = True
    """Compare every rank's step before each forward and backward (two tiny all-gathers per step)."""
    debug: bool | None = None
    """Also check every collective (one tiny all-gather each); ``None`` reads ``HYBRIDSHARD_DEBUG``."""
    stragglers: bool | None = None
    """Time each rank's compute and collectives and name slow ranks, nodes, links and racks every
    ``HYBRIDSHARD_STRAGGLER_STEPS`` steps (docs/diagnostics.md); ``None`` reads ``HYBRIDSHARD_STRAGGLERS``."""

    def __post_init__(self) -> None:
        _expect_bool("CheckConfig", "check_steps", self.check_steps)
        _expect_bool("CheckConfig", "debug", self.debug, optional=True)
        _expect_bool("CheckConfig", "stragglers", self.stragglers, optional=True)


@dataclass(frozen=True)
class InitConfig:
    """Where the sharded values come from."""

    sync_module_states: bool = False
    """Broadcast rank 0's values instead of checking that every rank holds the same ones."""
    param_init_fn: Callable[[nn.Module], None] | None = None
    """Initialises each module of a model built on the meta device (default: ``reset_parameters()``)."""
    init_seed: int | None = None
    """Seed of meta-device initialisation (default: rank 0's ``torch.initial_seed()``)."""

    def __post_init__(self) -> None:
        _expect_bool("InitConfig", "sync_module_states", self.sync_module_states)
        if self.param_init_fn is not None and not callable(self.param_init_fn):
            raise ValueError(
                f"InitConfig.param_init_fn expects a callable taking a module, found {self.param_init_fn!r}; "
                "pass a function or None (each module's reset_parameters())"
            )
        if self.init_seed is not None and (isinstance(self.init_seed, bool) or not isinstance(self.init_seed, int)):
            raise ValueError(f"InitConfig.init_seed expects an int or None, found {self.init_seed!r}; pass e.g. init_seed=0")


_GROUPS: dict[str, type] = {"comm": CommConfig, "checks": CheckConfig, "init": InitConfig}


def record_keywords() -> dict[str, str]:
    """``keyword -> record``: the keywords of ``shard`` that are fields of a record (``"prefetch": "comm"``)."""
    return {f.name: group for group, cls in _GROUPS.items() for f in fields(cls)}


def split_keywords(given: Mapping[str, Any], keywords: Mapping[str, Any]) -> dict[str, Any]:
    """The config records of ``shard``: ``given`` (``{"comm": CommConfig | None, ...}``) with the old
    keywords (``prefetch=``, ``check_steps=`` ...) folded into their records.

    A keyword of no record is a ``TypeError`` (as Python raises for a function's unknown keyword); one
    given both alone and inside its record is a ``ValueError``.
    """
    owner = record_keywords()
    unknown = sorted(k for k in keywords if k not in owner)
    if unknown:
        raise TypeError(f"shard() got an unexpected keyword argument {unknown[0]!r}")
    out = {}
    for group, cls in _GROUPS.items():
        record = given.get(group)
        if record is not None and not isinstance(record, cls):
            raise ValueError(
                f"{group}= expects a hybridshard.{cls.__name__}, found {record!r}; "
                f"pass {group}=hybridshard.{cls.__name__}(...)"
            )
        mine = {k: v for k, v in keywords.items() if owner[k] == group}
        if record is not None and mine:
            raise ValueError(
                f"shard() expects {sorted(mine)[0]} once, found it both as a keyword and in {group}="
                f"{cls.__name__}(...); pass it in one place"
            )
        out[group] = record if record is not None else cls(**mine)
    return out
