"""Whether a checkpoint's entries fit the model they are loaded into, checked before anything is read.

Sizes come from the checkpoint's metadata, which a checkpoint from elsewhere may have edited: a
parameter, buffer or optimizer entry whose size differs from the model's is refused by name here,
so no buffer of a size the file chose is ever allocated.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

__all__ = ["check_model", "check_state_size"]


def check_state_size(path: str, fqn: str, md: Any, shape: tuple[int, ...], *, per_element: bool) -> None:
    """An optimizer entry holds a value per element (the parameter's shape) or a few per parameter."""
    if not isinstance(md, TensorStorageMetadata):
        return
    size = tuple(md.size)
    if (per_element and size != tuple(shape)) or (not per_element and math.prod(size) > max(1, math.prod(shape))):
        raise ValueError(
            f"checkpoint {path}: optimizer entry {fqn!r} has size {list(size)}, its parameter {list(shape)} "
            f"({'the same shape' if per_element else 'at most as many elements'} expected); the checkpoint is damaged "
            "or was edited: load an earlier one"
        )


def check_model(path: str, stored: dict[str, Any], places: dict, buffers: dict[str, torch.Tensor]) -> None:
    """``ValueError`` naming every name and shape that differs between the checkpoint and the model."""
    saved = {k[len("model."):]: md for k, md in stored.items() if k.startswith("model.")}
    expected = {name: shape for name, (shape, _, _, _) in places.items()}
    expected.update({k: tuple(v.shape) for k, v in buffers.items()})
    missing = sorted(set(expected) - set(saved))
    unexpected = sorted(set(saved) - set(expected))
    shapes = [
        f"{n}: checkpoint {list(saved[n].size)}, model {list(expected[n])}"
        for n in sorted(set(saved) & set(expected))
        if isinstance(saved[n], TensorStorageMetadata) and tuple(saved[n].size) != tuple(expected[n])
    ]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing from the checkpoint: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
        if unexpected:
            parts.append(f"not in the model: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if shapes:
            parts.append("shapes differ: " + "; ".join(shapes[:8]))
        raise ValueError(
            f"checkpoint {path} does not match the model ({', '.join(parts)}); load it into the model it was "
            "saved from (the same parameter names and shapes; strategy and topology may differ)"
        )
