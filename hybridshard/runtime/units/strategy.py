"""What to shard and in which precision: :class:`ShardingStrategy` and :class:`MixedPrecision`."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

__all__ = ["MixedPrecision", "ShardingStrategy"]


class ShardingStrategy(enum.Enum):
    """How a model's parameters, gradients and optimizer state are spread over the ranks.

    ``ShardingStrategy["HYBRID_SHARD"]`` and :meth:`parse` (case-insensitive strings) both work.
    """

    FULL_SHARD = "full_shard"
    """ZeRO-3 over the whole job: gather before forward, free after it, gather again for backward."""
    SHARD_GRAD_OP = "shard_grad_op"
    """ZeRO-2 over the whole job: gather once before forward and keep the parameters until after backward."""
    NO_SHARD = "no_shard"
    """Replicated parameters, gradients all-reduced over the job (data-parallel semantics)."""
    HYBRID_SHARD = "hybrid_shard"
    """ZeRO-3 inside each shard group, replicated across shard groups."""
    HYBRID_SHARD_ZERO2 = "hybrid_shard_zero2"
    """ZeRO-2 inside each shard group, replicated across shard groups."""

    @classmethod
    def parse(cls, value: "ShardingStrategy | str") -> "ShardingStrategy":
        if isinstance(value, cls):
            return value
        if isinstance(value, str) and value.upper() in cls.__members__:
            return cls[value.upper()]
        names = ", ".join(cls.__members__)
        raise ValueError(f"strategy must be a ShardingStrategy or one of {names} (any case); got {value!r}; "
                         "pass e.g. strategy='HYBRID_SHARD' or hybridshard.ShardingStrategy.HYBRID_SHARD")

    @property
    def is_hybrid(self) -> bool:
        """True when gradients cross a replicate group after the shard group."""
        return self in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy.HYBRID_SHARD_ZERO2)

    @property
    def reshard_after_forward(self) -> bool:
        """True for the ZeRO-3 strategies, which free the gathered parameters between forward and backward."""
        return self in (ShardingStrategy.FULL_SHARD, ShardingStrategy.HYBRID_SHARD)


_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass(frozen=True)
class MixedPrecision:
    """Precisions of the gathered parameters and of the gradient reduction.

    The sharded master parameters the optimizer steps keep their own dtype (normally fp32).
    """

    param_dtype: torch.dtype | None = None
    """Dtype parameters are gathered and computed in; ``None`` keeps the parameters' dtype."""
    reduce_dtype: torch.dtype | None = None
    """Dtype gradients are reduced in; ``None`` means ``param_dtype`` (or the parameters' dtype)."""
    keep_low_precision_grads: bool = False
    """Leave the reduced gradient in ``param_dtype`` instead of casting it to the master dtype.

    Each ``.grad`` is then a ``param_dtype`` tensor next to a full-precision parameter (needs
    ``Tensor.grad_dtype``), so the optimizer must accept that: SGD, Adagrad and RMSprop do;
    torch's Adam and AdamW reject it at ``step()`` (as of torch 2.13).
    """

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype"):
            value = getattr(self, name)
            if value is not None and value not in _FLOAT_DTYPES:
                raise ValueError(
                    f"MixedPrecision.{name} must be a floating dtype ({', '.join(map(str, _FLOAT_DTYPES))}) "
                    f"or None; got {value!r}"
                )
