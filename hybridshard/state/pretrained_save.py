"""A sharded model written as a Hugging Face safetensors checkpoint that ``from_pretrained`` reads.

    hs.save_pretrained(model, "export", config=hf_model.config)      # collective; rank 0 writes

[Note: exporting unit by unit]
Each unit is gathered in its shard group (only the groups holding rank 0 gather, as in
``full_state_dict(rank0_only=True)``), moved to the CPU and written by rank 0 as one safetensors file,
``model-0000i-of-0000N.safetensors``, before the next unit is gathered: rank 0 holds one unit at a
time, in device and CPU memory alike. Persistent buffers go into the first file. The index
``model.safetensors.index.json`` maps every name to its file, as ``save_pretrained`` writes it.
Tied parameters are written once, under their first name (the input embedding for Hugging Face
models), which is what ``from_pretrained`` expects before it ties the others to it. ``config``
(anything with ``save_pretrained(dir)``, such as a ``PretrainedConfig``, or a dict written as
``config.json``) goes next to the weights.

Everything is written into ``<dir>.partial`` and renamed to ``<dir>`` once complete (an existing
``<dir>`` is moved aside first and deleted after the rename), so a failed export never leaves a
half-written directory where a complete one was.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from hybridshard.runtime.trace.position import api_call
from hybridshard.state.access import (
    check_idle, gather_unit, holds_rank0, is_sharded, master_shard, module_state_dict, units,
)
from hybridshard.state.checkpoint import _PARTIAL, _publish
from hybridshard.state.full import param_keys
from hybridshard.state.pretrained_load import INDEX, safetensors_module

logger = logging.getLogger(__name__)

__all__ = ["save_pretrained"]


def _names(model: nn.Module) -> dict[tuple[int, int], str]:
    """The one name each slot is written under: its first ``state_dict`` key."""
    out: dict[tuple[int, int], str] = {}
    for key, where in param_keys(model).items():
        out.setdefault(where, key.replace("_checkpoint_wrapped_module.", ""))
    return out


@api_call
def save_pretrained(model: nn.Module, path: str, *, config: Any = None, dtype: torch.dtype | None = None) -> None:
    """Write a sharded model as safetensors files plus index into ``path`` (and ``config``, when given),
    one unit at a time; see [Note: exporting unit by unit]. ``dtype`` casts floating tensors (e.g.
    ``torch.bfloat16``); by default they keep the master dtype. Collective: every rank calls it,
    rank 0 writes."""
    if not is_sharded(model):
        raise ValueError(
            f"save_pretrained writes a sharded model, but this {type(model).__name__} is not sharded; "
            "call model.save_pretrained(dir) (Hugging Face) or safetensors.torch.save_file(model.state_dict(), ...)"
        )
    check_idle(model, "save_pretrained")
    st = safetensors_module()
    import safetensors.torch  # noqa: F401 - loaded by safetensors_module

    writer = dist.get_rank() == 0
    path = os.path.abspath(path)
    partial = path + _PARTIAL
    if writer:
        shutil.rmtree(partial, ignore_errors=True)
        os.makedirs(partial)
    names = _names(model)
    keys = set(param_keys(model))
    buffers = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in module_state_dict(model).items()
               if k not in keys}
    sharded = [(u, unit) for u, unit in enumerate(units(model)) if unit.flat.layout.slots or u == 0]
    weight_map: dict[str, str] = {}
    total = 0

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    for n, (u, unit) in enumerate(sharded):
        flat, layout = unit.flat, unit.flat.layout
        flat.writeback_params()
        if not holds_rank0(unit) and not flat.separate_master:
            continue
        master = master_shard(unit)  # every replica takes part when it gathers the slices
        if not holds_rank0(unit):
            continue
        gathered = gather_unit(unit, master)
        if not writer:
            del gathered
            continue
        tensors = {names[(u, i)]: cast(gathered[s.offset : s.end].view(s.shape)).to("cpu", copy=True).contiguous()
                   for i, s in enumerate(layout.slots)}
        del gathered
        if u == 0:
            tensors.update((k, cast(v.detach()).to("cpu", copy=True).contiguous()) for k, v in buffers.items())
        file = f"model-{n + 1:05d}-of-{len(sharded):05d}.safetensors"
        st.torch.save_file(tensors, os.path.join(partial, file), metadata={"format": "pt"})
        weight_map.update((k, file) for k in tensors)
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if writer:
        with open(os.path.join(partial, INDEX), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, f, indent=2)
        if config is not None:
            if hasattr(config, "save_pretrained"):
                config.save_pretrained(partial)
            else:
                with open(os.path.join(partial, "config.json"), "w") as f:
                    json.dump(dict(config), f, indent=2)
        _publish(partial, path)
        logger.info("save_pretrained %s: %d files, %d bytes", path, len(sharded), total)
    dist.barrier()  # nobody returns (and reads the export) before it is there
