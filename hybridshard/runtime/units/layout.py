"""The flat-parameter layout: where each parameter of a unit lives in the flat buffer and in each shard.

A pure, immutable record computed from the parameter names and shapes and the shard-group size; it
touches no tensor and no process group, so it can be tested (and printed) on its own.

See [Note: flat layout] in docs/runtime.md for where each element lives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

__all__ = ["FlatLayout", "LocalSlice", "ParamSlot"]


@dataclass(frozen=True)
class ParamSlot:
    """One distinct parameter inside the flat buffer."""

    name: str
    """Fully qualified name, as ``named_parameters()`` reports it for the primary occurrence."""
    shape: tuple[int, ...]
    offset: int
    """First element in the (unsharded) flat buffer."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def end(self) -> int:
        return self.offset + self.numel


@dataclass(frozen=True)
class LocalSlice:
    """The part of one parameter that falls inside one rank's shard."""

    param_start: int
    """First element of the part, counted in the parameter flattened."""
    shard_offset: int
    """Where the part starts inside the rank's shard."""
    numel: int
    """Length of the part; 0 when the parameter misses this shard."""


@dataclass(frozen=True)
class FlatLayout:
    """Names, shapes, offsets and padding of one unit's flat parameter, and this rank's slice of it."""

    slots: tuple[ParamSlot, ...]
    aliases: tuple[tuple[str, str], ...]
    """``(alias name, primary name)`` for tied parameters; see [Note: flat layout]."""
    shard_size: int
    shard_rank: int
    align_numel: int
    padded_numel: int
    """Length of the unsharded flat buffer: a multiple of ``shard_size``."""

    def __post_init__(self) -> None:
        if self.shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {self.shard_size}")
        if not 0 <= self.shard_rank < self.shard_size:
            raise ValueError(f"shard_rank must be in [0, {self.shard_size}), got {self.shard_rank}")
        if self.padded_numel % self.shard_size:
            raise ValueError(f"padded_numel {self.padded_numel} is not a multiple of shard_size {self.shard_size}")

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, Sequence[int]]],
        *,
        shard_size: int,
        shard_rank: int,
        align_numel: int = 1,
        aliases: Sequence[tuple[str, str]] = (),
        shard_multiple: int = 1,
    ) -> "FlatLayout":
        """Lay out ``(name, shape)`` pairs in order; see [Note: flat layout].

        ``shard_multiple``: pad so that each shard also divides into that many equal parts (the
        replicas' optimizer slices; see [Note: optimizer state sharded across replicas] in
        :mod:`hybridshard.runtime.optim.replica_slices`)."""
        if shard_size < 1:
            raise ValueError(f"shard_size must be >= 1, got {shard_size}")
        if align_numel < 1:
            raise ValueError(f"align_numel must be >= 1, got {align_numel}")
        if shard_multiple < 1:
            raise ValueError(f"shard_multiple must be >= 1, got {shard_multiple}")
        names = [n for n, _ in params]
        if len(set(names)) != len(names):
            raise ValueError(f"parameter names must be distinct; got {names}")
        primaries = set(names)
        for alias, primary in aliases:
            if primary not in primaries:
                raise ValueError(f"alias {alias!r} points at {primary!r}, which is not a parameter of this layout")
        slots, cursor = [], 0
        for name, shape in params:
            cursor = -(-cursor // align_numel) * align_numel
            slot = ParamSlot(name=name, shape=tuple(int(d) for d in shape), offset=cursor)
            slots.append(slot)
            cursor = slot.end
        unit = shard_size * shard_multiple
        padded = max(-(-cursor // unit) * unit, unit)
        return cls(
            slots=tuple(slots),
            aliases=tuple((a, p) for a, p in aliases),
            shard_size=shard_size,
            shard_rank=shard_rank,
            align_numel=align_numel,
            padded_numel=padded,
        )

    @property
    def numel(self) -> int:
        """Elements that belong to parameters (padding excluded)."""
        return sum(s.numel for s in self.slots)

    @property
    def padding_numel(self) -> int:
        return self.padded_numel - self.numel

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.shard_size

    def shard_range(self, rank: int | None = None) -> tuple[int, int]:
        """``[start, end)`` of ``rank``'s chunk (this rank's by default) in the flat buffer."""
        rank = self.shard_rank if rank is None else rank
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def local_slices(self, rank: int | None = None) -> tuple[LocalSlice, ...]:
        """One :class:`LocalSlice` per slot for ``rank``'s chunk (this rank's by default)."""
        return self.slices_in(*self.shard_range(rank))

    def slices_in(self, start: int, end: int) -> tuple[LocalSlice, ...]:
        """One :class:`LocalSlice` per slot for the range ``[start, end)`` of the flat buffer
        (``shard_offset`` counted from ``start``); a rank's chunk, or part of one."""
        out = []
        for slot in self.slots:
            lo, hi = max(slot.offset, start), min(slot.end, end)
            if hi <= lo:
                out.append(LocalSlice(param_start=0, shard_offset=0, numel=0))
            else:
                out.append(LocalSlice(param_start=lo - slot.offset, shard_offset=lo - start, numel=hi - lo))
        return tuple(out)

    def slot(self, name: str) -> ParamSlot:
        primary = dict(self.aliases).get(name, name)
        for s in self.slots:
            if s.name == primary:
                return s
        raise KeyError(f"{name!r} is not a parameter of this layout")

    def to_dict(self) -> dict[str, Any]:
        return {
            "slots": [{"name": s.name, "shape": list(s.shape), "offset": s.offset} for s in self.slots],
            "aliases": [list(a) for a in self.aliases],
            "shard_size": self.shard_size,
            "shard_rank": self.shard_rank,
            "align_numel": self.align_numel,
            "padded_numel": self.padded_numel,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "FlatLayout":
        return cls(
            slots=tuple(ParamSlot(name=s["name"], shape=tuple(s["shape"]), offset=int(s["offset"])) for s in d["slots"]),
            aliases=tuple((a, p) for a, p in d.get("aliases", ())),
            shard_size=int(d["shard_size"]),
            shard_rank=int(d["shard_rank"]),
            align_numel=int(d["align_numel"]),
            padded_numel=int(d["padded_numel"]),
        )
