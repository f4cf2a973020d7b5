"""What the trainer integrations share: the missing-extra error, sharding a model a trainer hands over,
and the trainers' own state made plain for a checkpoint's ``extra``."""

from __future__ import annotations

import argparse
import importlib
import logging
import os
from collections import OrderedDict
from types import ModuleType
from typing import Any

import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.runtime.engine import holds_sharded_module, is_sharded

logger = logging.getLogger(__name__)

STRATEGY_NAMES = {
    "hybridshard": "HYBRID_SHARD",
    "hybridshard_zero2": "HYBRID_SHARD_ZERO2",
    "hybridshard_full_shard": "FULL_SHARD",
    "hybridshard_shard_grad_op": "SHARD_GRAD_OP",
    "hybridshard_no_shard": "NO_SHARD",
}
"""The names Lightning's ``Trainer`` and Fabric accept as ``strategy=`` once the integration is imported."""


def require(module: str, extra: str) -> ModuleType:
    """Import ``module``, or raise an ``ImportError`` that names the extra which installs it."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise ImportError(
            f"hybridshard.integrations needs the package '{module}', which is not installed ({e}); "
            f"install it with: pip install 'hybridshard[{extra}]'"
        ) from e


def layer_classes(model: nn.Module) -> set[type]:
    """The classes named by Hugging Face's ``_no_split_modules`` (the decoder layers), found in ``model``.

    This is the default unit of the accelerate FSDP plugin's transformer auto-wrap policy, so a model
    sharded here is split into the same units an FSDP user gets without naming a class."""
    names: set[str] = set()
    for module in model.modules():
        names.update(getattr(module, "_no_split_modules", None) or ())
    found = {type(m) for m in model.modules() if type(m).__name__ in names}
    if names and not found:
        raise ValueError(
            f"{type(model).__name__}._no_split_modules names {sorted(names)}, but no module of that class is in the "
            "model; pass wrap={YourLayerClass} to choose the units"
        )
    return found


def shard_model(model: nn.Module, *, strategy: Any, wrap: Any, groups: Any, shard_kwargs: dict[str, Any]) -> nn.Module:
    """Shard ``model`` in place for a trainer and return the module that holds the runtime: ``model``, or,
    when the caller sharded it (or a submodule) already, that module, unchanged.

    ``wrap=None`` takes the decoder-layer classes of a Hugging Face model (:func:`layer_classes`);
    ``groups=None`` builds them from the discovered topology when the strategy is hybrid (unless
    ``shard_kwargs`` holds a ``mesh``)."""
    if not dist.is_initialized():
        raise RuntimeError(
            "hybridshard needs an initialised default process group before the model is sharded, but none exists; "
            "launch with torchrun (or `hybridshard launch`) so the trainer initialises it"
        )
    if holds_sharded_module(model):
        return sharded_module(model)
    if wrap is None:
        wrap = layer_classes(model) or None
    if groups is None and shard_kwargs.get("mesh") is None and hs.ShardingStrategy.parse(strategy).is_hybrid:
        groups = hs.init_groups()
    logger.info("sharding %s with %s, units %s", type(model).__name__, strategy, wrap)
    return hs.shard(model, strategy=strategy, wrap=wrap, groups=groups, **shard_kwargs)


def sharded_module(model: nn.Module) -> nn.Module:
    """The outermost module of ``model`` that went through :func:`hybridshard.shard`."""
    for module in model.modules():
        if is_sharded(module):
            return module
    raise ValueError(f"{type(model).__name__} holds no sharded module; shard it first (hybridshard.shard)")


def plain_values(value: Any, name: str) -> tuple[Any, list[str]]:
    """``value`` with what trainers put in their checkpoint state converted to plain values, and the key
    paths converted (see [Note: checkpoints are data] in :mod:`hybridshard.state.trust`).

    Converted: mappings that are not a ``dict`` (Lightning's ``AttributeDict`` hyperparameters, an
    omegaconf ``DictConfig`` once resolved) to ``dict``; ``argparse.Namespace`` to the dict of its
    attributes; paths (``os.PathLike``) to ``str``; numpy scalars to Python numbers and numpy arrays to
    tensors; classes (Lightning's ``hparams_type``) to their qualified name. Anything else is returned
    as it is, and ``save_checkpoint`` refuses it if it is not plain."""
    converted: list[str] = []

    def walk(v: Any, path: str) -> Any:
        kind = type(v)
        if kind in (dict, OrderedDict):
            return kind((k, walk(x, f"{path}[{k!r}]")) for k, x in v.items())
        if kind in (list, tuple, set):
            return kind(walk(x, f"{path}[{i}]") for i, x in enumerate(v))
        plain = _convert(v)
        if plain is v:
            return v
        converted.append(f"{path} ({kind.__module__}.{kind.__qualname__})")
        return walk(plain, path) if type(plain) in (dict, list) else plain

    return walk(value, name), converted


def _convert(v: Any) -> Any:
    """A plain stand-in for ``v``, or ``v`` itself."""
    if isinstance(v, argparse.Namespace):
        return dict(vars(v))
    if isinstance(v, os.PathLike):
        return os.fspath(v)
    if isinstance(v, type):
        return f"{v.__module__}.{v.__qualname__}"
    module = type(v).__module__.split(".")[0]
    if module == "numpy":
        import numpy as np
        import torch

        if isinstance(v, np.generic):
            return v.item()
        if isinstance(v, np.ndarray):
            return torch.from_numpy(v.copy())
    if module == "omegaconf":
        from omegaconf import OmegaConf

        return OmegaConf.to_container(v, resolve=True)
    if isinstance(v, dict) and type(v) not in (dict, OrderedDict):
        return dict(v)  # AttributeDict and other dict subclasses
    return v
