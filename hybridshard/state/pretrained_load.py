"""Pretrained Hugging Face weights (safetensors) read straight into a sharded model's shards.

    model = hs.shard(meta_model, strategy="HYBRID_SHARD", wrap={Block}, param_init_fn=meta_model._init_weights)
    result = hs.load_pretrained(model, "path/to/checkpoint")          # collective

[Note: striped pretrained reads]
A checkpoint directory holds ``model.safetensors`` or shards listed in
``model.safetensors.index.json``; each tensor is stored whole under its ``state_dict`` name. A rank
needs only the range of each unit's flat buffer it holds (see [Note: flat layout]), and every rank
of its replicate group needs the very same range. So the range is split into ``R`` equal stripes
(``R`` = the unit's replicate size), replica ``r`` reads stripe ``r`` and one all-gather over the
replicate group gives every replica the whole range: storage serves each byte once per job, not
``R`` times. A stripe covers a run of elements of the flattened parameters; ``safe_open(...).get_slice``
reads whole rows of a parameter's first dimension, so a stripe reads at most a partial row more at
each end of each parameter it touches. Units are loaded one at a time and gathered straight into
the master shard (through a shard-sized buffer only when the range does not split into ``R`` equal
stripes), so a rank holds its shards plus one stripe and the rows it is reading.

Names and shapes are checked against the files' headers (no tensor data) before anything is read:
a parameter missing from the checkpoint, or of another shape, raises a ``ValueError`` naming it and
nothing is changed. Tied parameters are found under any of their names (``lm_head.weight`` tied to
``transformer.wte.weight``: whichever the checkpoint holds). Persistent buffers found in the
checkpoint are read whole by every rank; buffers it lacks (non-persistent ones, such as rotary
frequencies) keep the values their init gave them.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn

from hybridshard.runtime.comm import collectives as C
from hybridshard.runtime.trace.position import api_call
from hybridshard.state.access import check_idle, is_sharded, module_state_dict, units
from hybridshard.state.full import param_keys

logger = logging.getLogger(__name__)

__all__ = ["LoadResult", "checkpoint_index", "load_pretrained", "safetensors_module"]

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
             "F8_E4M3": 1, "F8_E5M2": 1}


@dataclass(frozen=True)
class LoadResult:
    """What one :func:`load_pretrained` call read on this rank."""

    bytes_read: int
    """Tensor bytes this rank read from the files (its stripes, whole rows, and the buffers)."""
    bytes_unstriped: int
    """Tensor bytes it would read if every replica read its whole range itself."""
    bytes_model: int
    """Tensor bytes of every loaded parameter and buffer: what a rank reading everything would read."""
    seconds: float


def safetensors_module() -> Any:
    try:
        import safetensors.torch  # noqa: F401
        import safetensors
    except ImportError as e:  # pragma: no cover - the test extra installs it
        raise ImportError(
            "reading and writing Hugging Face checkpoints needs the safetensors package, which is not installed; "
            "pip install safetensors (or pip install 'hybridshard[hf]')"
        ) from e
    return safetensors


def checkpoint_index(path: str) -> dict[str, str]:
    """``tensor name -> file path`` of a safetensors checkpoint directory (or single file)."""
    if os.path.isfile(path) and path.endswith(".safetensors"):
        files = {path: None}
    elif os.path.isfile(os.path.join(path, INDEX)):
        with open(os.path.join(path, INDEX)) as f:
            weight_map = json.load(f)["weight_map"]
        return {k: os.path.join(path, v) for k, v in weight_map.items()}
    elif os.path.isfile(os.path.join(path, SINGLE)):
        files = {os.path.join(path, SINGLE): None}
    else:
        found = sorted(os.listdir(path))[:10] if os.path.isdir(path) else "no such directory"
        raise ValueError(
            f"expected a Hugging Face checkpoint: a directory with {SINGLE} or {INDEX}, or a .safetensors file; "
            f"found {found} at {path!r}. Save one with model.save_pretrained(dir) or hybridshard.save_pretrained"
        )
    st = safetensors_module()
    out = {}
    for file in files:
        with st.safe_open(file, framework="pt") as handle:
            out.update((k, file) for k in handle.keys())
    return out


def _rows(shape: tuple[int, ...], start: int, numel: int) -> tuple[int, int, int]:
    """``(first row, end row, elements per row)`` covering ``[start, start + numel)`` of a flattened tensor."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return start // row, -(-(start + numel) // row), row


class _Reader:
    """Open files, header lookups and byte counts for one load."""

    def __init__(self, index: dict[str, str], stack: contextlib.ExitStack) -> None:
        self.index, self.stack = index, stack
        self.handles: dict[str, Any] = {}
        self.bytes_read = 0

    def handle(self, key: str) -> Any:
        file = self.index[key]
        if file not in self.handles:
            st = safetensors_module()
            self.handles[file] = self.stack.enter_context(st.safe_open(file, framework="pt", device="cpu"))
        return self.handles[file]

    def header(self, key: str) -> tuple[tuple[int, ...], int]:
        sl = self.handle(key).get_slice(key)
        return tuple(int(d) for d in sl.get_shape()), _ITEMSIZE.get(sl.get_dtype(), 4)

    def read(self, key: str, start: int, numel: int) -> torch.Tensor:
        """Elements ``[start, start + numel)`` of the flattened tensor ``key``, reading whole rows."""
        shape, _ = self.header(key)
        if not shape:
            t = self.handle(key).get_tensor(key).reshape(-1)
        else:
            first, end, row = _rows(shape, start, numel)
            t = self.handle(key).get_slice(key)[first:end].reshape(-1)
            start -= first * row
        self.bytes_read += t.numel() * t.element_size()
        return t[start : start + numel]


def _match(model: nn.Module, index: dict[str, str]) -> tuple[dict[tuple[int, int], str], dict[str, torch.Tensor]]:
    """The checkpoint name of every slot, and the buffers the checkpoint holds; ``ValueError`` on a missing parameter."""
    names: dict[tuple[int, int], list[str]] = {}
    keys = param_keys(model)
    for key, where in keys.items():
        names.setdefault(where, []).append(key.replace("_checkpoint_wrapped_module.", ""))
    found, missing = {}, []
    for where, candidates in names.items():
        hit = next((k for k in candidates if k in index), None)
        if hit is None:
            missing.append(" or ".join(repr(k) for k in candidates))
        else:
            found[where] = hit
    if missing:
        raise ValueError(
            f"the checkpoint lacks {len(missing)} parameter(s) of the model: {', '.join(missing[:5])}"
            f"{' ...' if len(missing) > 5 else ''}; nothing was loaded. Load a checkpoint of this model's "
            "architecture (the names of model.named_parameters())"
        )
    buffers = {k.replace("_checkpoint_wrapped_module.", ""): v
               for k, v in module_state_dict(model, keep_vars=True).items() if k not in keys}
    return found, buffers


@api_call
def load_pretrained(model: nn.Module, path: str) -> LoadResult:
    """Read a Hugging Face safetensors checkpoint (``path``: a directory or a ``.safetensors`` file)
    into a sharded model, each rank reading only its stripe of its own shards; see [Note: striped
    pretrained reads]. Collective over the model's groups: every rank calls it."""
    if not is_sharded(model):
        raise ValueError(
            f"load_pretrained reads into a sharded model's shards, but this {type(model).__name__} is not sharded; "
            "call hybridshard.shard(model, ...) first (for one process, use from_pretrained or load_state_dict)"
        )
    check_idle(model, "load_pretrained")
    started = time.perf_counter()
    index = checkpoint_index(path)
    found, buffers = _match(model, index)
    sharded = units(model)
    with contextlib.ExitStack() as stack:
        reader = _Reader(index, stack)
        bad = []
        for (u, i), key in found.items():
            shape = sharded[u].flat.layout.slots[i].shape
            if reader.header(key)[0] != tuple(shape):
                bad.append(f"{key}: checkpoint {list(reader.header(key)[0])}, model {list(shape)}")
        for key, value in buffers.items():
            if key in index and reader.header(key)[0] != tuple(value.shape):
                bad.append(f"{key}: checkpoint {list(reader.header(key)[0])}, model {list(value.shape)}")
        if bad:
            raise ValueError(f"the checkpoint's shapes differ from the model's: {'; '.join(bad[:5])}; nothing was loaded")
        unstriped = model_bytes = 0
        for u, unit in enumerate(sharded):
            unstriped, model_bytes = _load_unit(unit, u, found, reader, unstriped, model_bytes)
        with torch.no_grad():
            for key, value in buffers.items():
                if key in index:
                    t = reader.read(key, 0, value.numel())
                    value.copy_(t.view(value.shape))
                    model_bytes += t.numel() * t.element_size()
                    unstriped += t.numel() * t.element_size()
                else:
                    logger.info("load_pretrained: buffer %s is not in the checkpoint; it keeps its value", key)
        read = reader.bytes_read
    result = LoadResult(read, unstriped, model_bytes, time.perf_counter() - started)
    logger.info("load_pretrained %s: read %d bytes (%d without striping, %d in the model) in %.2f s",
                path, read, unstriped, model_bytes, result.seconds)
    return result


def _load_unit(unit: Any, u: int, found: dict, reader: _Reader, unstriped: int, model_bytes: int) -> tuple[int, int]:
    """Read one unit's stripe, gather the range across the replicate group, copy it into the master."""
    flat, layout, groups = unit.flat, unit.flat.layout, unit.groups
    start, end = layout.shard_range()
    for i, (slot, part) in enumerate(zip(layout.slots, flat.local)):
        shape, itemsize = reader.header(found[(u, i)])
        model_bytes += slot.numel * itemsize
        if part.numel:
            first, last, row = _rows(shape, part.param_start, part.numel)
            unstriped += (last - first) * row * itemsize
    stripe = -(-layout.shard_numel // groups.replicate_size)
    lo = min(start + groups.replicate_rank * stripe, end)
    hi = min(lo + stripe, end)
    # The collective runs on the compute device; an offloaded master (CPU memory) takes a copy.
    mine = torch.zeros(stripe, dtype=flat.owned.dtype, device=flat.device)
    direct = flat.sharded.device == flat.device
    with torch.no_grad():
        for i, part in enumerate(layout.slices_in(lo, hi)):
            if part.numel:
                values = reader.read(found[(u, i)], part.param_start, part.numel)
                mine[part.shard_offset : part.shard_offset + part.numel].copy_(values)
        if flat.separate_master:  # this stripe is the replica's master slice: kept in the master dtype
            flat.owned.copy_(mine)
            mine = mine.to(flat.sharded.dtype)
        if groups.replicate_size == 1:
            flat.sharded.copy_(mine[: layout.shard_numel])
        elif direct and stripe * groups.replicate_size == layout.shard_numel:  # the stripes tile the shard
            C.all_gather(flat.sharded, mine, groups.replicate)
        else:  # the last stripe is short: gather padded, keep the shard's part
            gathered = torch.empty(stripe * groups.replicate_size, dtype=mine.dtype, device=mine.device)
            C.all_gather(gathered, mine, groups.replicate)
            flat.sharded.copy_(gathered[: layout.shard_numel])
            del gathered
        flat.use_sharded_params()
    return unstriped, model_bytes
