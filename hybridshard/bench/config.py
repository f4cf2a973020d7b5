"""What one benchmark job runs: the systems, the ``hybridshard`` variants, the model and the schedule.

[Note: bench variants]
``--variants`` lists the hybridshard contestants, each ``hybridshard`` optionally followed by
``:key=value`` pairs that become keyword arguments of :func:`hybridshard.shard`, e.g.
``hybridshard:prefetch=0`` or ``hybridshard:replicate_compression=int8``. Values are parsed as
``none`` -> ``None``, ``true``/``false`` -> bool, an integer, a float, else the string. A key
:func:`hybridshard.shard` does not accept (checked with ``inspect.signature``) is a ``ValueError``
before any rank starts, so an option that this version of the runtime lacks fails clearly.
"""

from __future__ import annotations

import enum
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

__all__ = ["BenchConfig", "Contestant", "System", "contestants", "parse_variant", "DEFAULT_SYSTEMS"]


class System(enum.Enum):
    """A training system the benchmark runs, all on the same model, groups and data."""

    HYBRIDSHARD = "hybridshard"
    """``hybridshard.shard`` with the job's strategy on ``init_groups()``, one unit per block."""
    FSDP1 = "fsdp1"
    """``FullyShardedDataParallel`` with the matching hybrid strategy on ``(shard, replicate)``."""
    FSDP2 = "fsdp2"
    """``fully_shard`` per block and on the root, over ``groups.mesh`` (HSDP)."""
    FLOOR = "floor"
    """The unsharded model on every rank with no communication at all: the compute floor."""

    @classmethod
    def parse(cls, value: str) -> "System":
        try:
            return cls(value.strip().lower())
        except ValueError:
            names = ", ".join(s.value for s in cls)
            raise ValueError(f"unknown system {value!r}; expected one of {names}") from None


DEFAULT_SYSTEMS = (System.HYBRIDSHARD, System.FSDP1, System.FSDP2, System.FLOOR)
_STRATEGIES = ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")


@dataclass(frozen=True)
class Contestant:
    """One column of the results: a system, and for hybridshard the extra ``shard()`` options."""

    system: System
    options: tuple[tuple[str, Any], ...] = ()
    """Keyword arguments for :func:`hybridshard.shard` (hybridshard only), in the order given."""

    @property
    def name(self) -> str:
        if not self.options:
            return self.system.value
        return self.system.value + ":" + ",".join(f"{k}={_render(v)}" for k, v in self.options)


def _render(value: Any) -> str:
    return "none" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def _parse_value(text: str) -> Any:
    lowered = text.strip().lower()
    if lowered == "none":
        return None
    if lowered in ("true", "false"):
        return lowered == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text.strip()


def parse_variant(text: str, accepted: Callable[[], Sequence[str]] | None = None) -> Contestant:
    """``hybridshard[:key=value[:key=value...]]`` -> a :class:`Contestant`; see [Note: bench variants].

    Options are separated by ``:`` (commas separate the variants on the command line); ``,`` works
    too when the text is one variant."""
    head, _, rest = text.strip().partition(":")
    if head.strip().lower() != System.HYBRIDSHARD.value:
        raise ValueError(
            f"variant {text!r} must start with 'hybridshard' (e.g. hybridshard:prefetch=0); other systems "
            "are chosen with --systems"
        )
    options: list[tuple[str, Any]] = []
    for item in filter(None, (part.strip() for part in rest.replace(",", ":").split(":"))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip().isidentifier():
            raise ValueError(f"variant {text!r}: expected key=value pairs after ':', found {item!r}")
        options.append((key.strip(), _parse_value(value)))
    names = list(accepted()) if accepted is not None else shard_options()
    unknown = [k for k, _ in options if k not in names]
    if unknown:
        raise ValueError(
            f"variant {text!r}: hybridshard.shard() in this version does not accept {unknown}; it accepts "
            f"{sorted(names)}. Drop the variant, or update hybridshard to a version with that option"
        )
    return Contestant(System.HYBRIDSHARD, tuple(options))


_FIXED_BY_BENCH = ("model", "strategy", "groups", "mesh", "wrap", "device")


def shard_options() -> list[str]:
    """The keyword options of :func:`hybridshard.shard` a variant may set (those the bench fixes excluded)."""
    from hybridshard import shard
    from hybridshard.options import record_keywords

    params = inspect.signature(shard).parameters.values()
    names = [p.name for p in params if p.kind is inspect.Parameter.KEYWORD_ONLY and p.name not in _FIXED_BY_BENCH]
    return names + list(record_keywords())  # prefetch=, check_steps= ... (each a field of comm=, checks=, init=)


def contestants(systems: Sequence[System], variants: Sequence[Contestant]) -> list[Contestant]:
    """The columns in order: every variant where ``hybridshard`` is listed, the other systems as they are."""
    out: list[Contestant] = []
    for system in systems:
        out += list(variants) if system is System.HYBRIDSHARD else [Contestant(system)]
    names = [c.name for c in out]
    if len(set(names)) != len(names):
        raise ValueError(f"systems and variants name the same contestant twice: {names}; list each once")
    return out


@dataclass(frozen=True)
class BenchConfig:
    """Everything a worker needs; the same on every rank (it travels on the command line)."""

    strategy: str = "HYBRID_SHARD"
    """``HYBRID_SHARD`` (ZeRO-3 in the node) or ``HYBRID_SHARD_ZERO2``."""
    contestants: tuple[Contestant, ...] = field(default_factory=lambda: tuple(Contestant(s) for s in DEFAULT_SYSTEMS))
    steps: int = 3
    """Timed steps of each contestant per round."""
    warmup: int = 2
    """Untimed steps of each contestant before the rounds (the last one is measured for bytes and memory)."""
    rounds: int = 3
    """Rounds; each runs ``steps`` steps of every contestant, the order rotated by one per round."""
    d_model: int = 256
    layers: int = 6
    heads: int = 4
    seq: int = 64
    batch: int = 8
    """Global batch in sequences, split evenly over the ranks."""
    vocab: int = 256
    lr: float = 3e-3
    seed: int = 0
    timeout_s: float = 300.0
    """Process-group timeout: a collective that cannot finish fails after this long."""
    compile: bool = False
    """``--compile``: FSDP2 compiles each block after ``fully_shard`` (``block.compile()``), every contestant
    compiles cold (see [Note: cold compiles]), and the first step's time, frames, graph breaks and
    recompiles are reported (see [Note: bench compile counts])."""

    def __post_init__(self) -> None:
        if self.strategy not in _STRATEGIES:
            raise ValueError(f"strategy must be one of {', '.join(_STRATEGIES)} (any case); got {self.strategy!r}")
        if not self.contestants:
            raise ValueError("nothing to run: --systems is empty; pass e.g. --systems hybridshard,fsdp1,fsdp2,floor")
        for name in ("steps", "warmup", "rounds", "d_model", "layers", "heads", "seq", "batch", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name.replace('_', '-')} must be >= 1, found {getattr(self, name)}")
        if self.d_model % self.heads:
            raise ValueError(f"--d-model {self.d_model} must divide by --heads {self.heads}")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr must be a positive number, found {self.lr}")

    def check_world(self, world_size: int) -> None:
        if self.batch % world_size:
            raise ValueError(
                f"--batch {self.batch} must divide by the number of ranks {world_size}; pass a multiple of it"
            )
