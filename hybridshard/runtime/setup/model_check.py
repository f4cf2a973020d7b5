"""Checks that every rank is about to shard the same model in the same way, before any unit exists.

Ranks that built different models (another seed, a rank-dependent branch) or split them into
different units would issue different collectives and hang or silently mix tensors. One small
all-gather of a digest (names, shapes, dtypes, frozen-ness, value sums, the unit plan) catches that;
only when the digests differ does the slow path find and name the first difference, on every
rank alike.
"""

from __future__ import annotations

import logging
import zlib
from typing import Any, Sequence

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.topology.groups import collective_device

logger = logging.getLogger(__name__)

__all__ = ["INIT_SEED", "check_devices", "check_same_model"]

INIT_SEED = "<init seed>"
"""The plan entry that carries deferred init's seed: ranks with different seeds would build different models."""


def check_devices(model: nn.Module, device: torch.device) -> None:
    for name, p in model.named_parameters():
        if p.device == device or p.device.type in ("cpu", "meta"):
            continue
        raise ValueError(
            f"parameter {name!r} is on {p.device}, but this rank computes on {device}; create the model on "
            f"the CPU or on {device} (materialize meta parameters first), or pass device={p.device}"
        )


_CHUNK_NUMEL = 1 << 16


def _sums(p: torch.Tensor) -> tuple[float, float]:
    """Sum and absolute sum in float64, a chunk at a time: never a float64 copy of the parameter."""
    s = a = 0.0
    for chunk in p.detach().reshape(-1).split(_CHUNK_NUMEL):
        d = chunk.double()
        s += float(d.sum())
        a += float(d.abs_().sum())
        del d  # before the next chunk's copy: one float64 chunk alive at a time
    return s, a


def _digest(model: nn.Module, values: bool) -> list[tuple[str, tuple[int, ...], str, str, str]]:
    """Per parameter: name, shape, dtype and frozen-ness, and (``values``, not on meta) its sums.

    A parameter on the meta device has no values yet: deferred init gives it the same ones on every
    rank (see :mod:`hybridshard.runtime.setup.deferred_init`), so only its structure is compared.
    """
    out = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            s, a = _sums(p) if values and not p.is_meta else (0.0, 0.0)
            # Hex strings compare equal for equal values, NaN included. Frozen-ness is structure: a
            # parameter frozen on some ranks only would reduce gradients on the others alone.
            kind = str(p.dtype) + ("" if p.requires_grad else " frozen") + (" meta" if p.is_meta else "")
            out.append((name, tuple(p.shape), kind, s.hex(), a.hex()))
    return out


def check_same_model(model: nn.Module, *, values: bool, plan: Sequence[tuple[str, str]]) -> None:
    """One small all-gather of a model digest; on a mismatch, name the first differing parameter or unit.

    ``plan`` is the ``(unit, strategy)`` list: ranks that split the model differently would issue
    different collectives and hang. Values are compared too unless ``sync_module_states`` will
    overwrite them anyway.
    """
    rows = _digest(model, values)
    structure = zlib.crc32(repr(([r[:3] for r in rows], list(plan))).encode())
    summary = torch.tensor(
        [len(rows), structure, sum(float.fromhex(r[3]) for r in rows), sum(float.fromhex(r[4]) for r in rows)],
        dtype=torch.float64,
    )
    summary = summary.to(collective_device())
    gathered = torch.empty(dist.get_world_size() * summary.numel(), dtype=torch.float64, device=summary.device)
    C.all_gather(gathered, summary, dist.group.WORLD)
    gathered = gathered.view(dist.get_world_size(), -1)
    if bool((gathered == gathered[0]).all()):
        return
    if bool(((gathered == gathered[0]) | (gathered.isnan() & gathered[0].isnan())).all()):
        return  # identical, NaN values included (NaN != NaN would otherwise look like a difference)
    # Slow path, taken by every rank alike: find the first parameter, then the first unit, that differs.
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (rows, list(plan)))
    for i in range(max(len(r) for r, _ in everyone)):
        column = [r[i] if i < len(r) else None for r, _ in everyone]
        for rank, entry in enumerate(column):
            if entry != column[0]:
                name = (column[0] or entry)[0]
                raise ValueError(
                    f"the model differs across ranks at parameter {name!r}: rank 0 has {_describe(column[0])}, "
                    f"rank {rank} has {_describe(entry)}. Build the model identically on every rank (same "
                    "code and seed), or pass sync_module_states=True to copy rank 0's values"
                )
    for i in range(max(len(p) for _, p in everyone)):
        column = [p[i] if i < len(p) else None for _, p in everyone]
        for rank, entry in enumerate(column):
            if entry != column[0] and column[0] is not None and column[0][0] == INIT_SEED and entry is not None:
                raise ValueError(
                    f"the init seed differs across ranks: rank 0 has {column[0][1]}, rank {rank} has {entry[1]}; pass "
                    "every rank the same shard(init_seed=...), or leave it out to use rank 0's torch.initial_seed()"
                )
            if entry != column[0]:
                raise ValueError(
                    f"the units differ across ranks at unit #{i}: rank 0 has {_describe_unit(column[0])}, rank "
                    f"{rank} has {_describe_unit(entry)}. Pass every rank the same strategy and a wrap policy "
                    "that decides from the module alone (not from the rank)"
                )


def _describe_unit(entry: tuple[str, str] | None) -> str:
    return "no such unit" if entry is None else f"{entry[0]!r} with {entry[1]}"


def _describe(entry: Any) -> str:
    if entry is None:
        return "no such parameter"
    name, shape, dtype, s, a = entry
    return f"{name} shape {list(shape)} {dtype} (sum {float.fromhex(s):.6g}, abs sum {float.fromhex(a):.6g})"
