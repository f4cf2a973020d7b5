"""Deferred init: a model built under ``torch.device("meta")`` gets its values one unit at a time.

[Note: deferred init]
A model too large for one process is built on the meta device (shapes and dtypes, no storage) and
handed to ``shard`` as it is. ``shard`` goes through the units in order, and for the modules of one
unit (under its module and not under another unit's, plus the module holding each of its
parameters; a trainable and frozen part are done once for both):

1. gives every meta parameter a fresh full-size tensor on the device (a new ``nn.Parameter`` under
   every name holding it, so ties hold), and every meta buffer of those modules one too;
2. initialises each module, children before parents, with ``param_init_fn(module)`` when given,
   else ``module.reset_parameters()`` (the FSDP2 and torchtitan convention). Either sets the
   module's *own* tensors, or its descendants' when its subtree is all in the unit and all meta
   (Hugging Face's GPT-2 scales its ``c_proj`` there);
3. copies this rank's range of each parameter into the master shard and drops the full tensors.

So a rank holds its shards plus one unit, never the model. The generator is seeded before each
module from ``shard(init_seed=...)`` (compared across ranks; by default rank 0's
``torch.initial_seed()``) and the module's name, so the values depend on neither rank, topology nor
wrap policy: :func:`materialize` gives the same model in one process, unsharded.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import replace
from typing import Callable, Iterable, Sequence

import torch
import torch.nn as nn

from hybridshard.runtime.units.wrap import UnitSpec, choose_units

logger = logging.getLogger(__name__)

__all__ = ["DeferredInit", "has_meta", "materialize"]

InitFn = Callable[[nn.Module], None]


def has_meta(model: nn.Module) -> bool:
    """Whether any parameter or buffer of ``model`` is on the meta device."""
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def _holds_meta(module: nn.Module) -> bool:
    return any(t is not None and t.is_meta for t in (*module._parameters.values(), *module._buffers.values()))


class DeferredInit:
    """Materialises and initialises a meta model unit by unit; see [Note: deferred init]."""

    def __init__(self, model: nn.Module, device: torch.device, param_init_fn: InitFn | None, seed: int = 0) -> None:
        self.device = device
        self.param_init_fn = param_init_fn
        self.seed = int(seed)
        """Set before the first unit is materialised (``shard`` agrees on it across ranks first)."""
        self.names = {id(m): n for n, m in model.named_modules()}
        self.post_order: dict[int, int] = {}
        self.held: list[torch.Tensor] = []
        """The full tensors of the unit being built, dropped by :meth:`release` once it holds its shard."""
        self._walk(model)
        missing = [
            f"{self.names[id(m)] or '<root>'!r} ({type(m).__name__})"
            for m in model.modules()
            if _holds_meta(m) and param_init_fn is None and not callable(getattr(m, "reset_parameters", None))
        ]
        if missing:
            raise ValueError(
                f"every module holding meta parameters or buffers needs an init, but {', '.join(missing[:5])}"
                f"{' ...' if len(missing) > 5 else ''} has no reset_parameters(); pass shard(..., param_init_fn=fn), "
                "fn(module) setting one module's own parameters and buffers (for a Hugging Face model: "
                "param_init_fn=model._init_weights)"
            )

    def _walk(self, module: nn.Module) -> None:
        if id(module) in self.post_order:
            return
        self.post_order[id(module)] = -1  # visiting: a module reached twice is done once
        for child in module.children():
            self._walk(child)
        self.post_order[id(module)] = len(self.post_order)

    def seed_for(self, module: nn.Module) -> int:
        """The generator's seed before ``module`` is initialised: the seed and the module's name only."""
        return (self.seed * 1_000_003 + zlib.crc32(self.names.get(id(module), "").encode())) % (1 << 63)

    def materialize_specs(self, specs: Sequence[UnitSpec], other_units: Iterable[nn.Module]) -> list[UnitSpec]:
        """Materialise and initialise ``specs`` (one module's units: a unit, or its trainable and frozen
        parts) and return them with their new parameters."""
        stop = {id(m) for m in other_units} - {id(specs[0].module)}
        modules: dict[int, nn.Module] = {}
        todo = [specs[0].module]
        while todo:
            m = todo.pop()
            if id(m) in modules or id(m) in stop:
                continue
            modules[id(m)] = m
            todo.extend(m.children())
        init = {id(m): m for m in modules.values() if _holds_meta(m) or self._meta_container(m, stop)}
        out = []
        for spec in specs:
            new_params = []
            for p, bindings in zip(spec.params, spec.bindings):
                if p.is_meta:
                    full = torch.empty(p.shape, dtype=p.dtype, device=self.device)
                    self.held.append(full)
                    p = nn.Parameter(full, requires_grad=p.requires_grad)
                    for m, attr in bindings:
                        m._parameters[attr] = p
                    init.setdefault(id(bindings[0][0]), bindings[0][0])
                new_params.append(p)
            out.append(replace(spec, params=tuple(new_params)))
        self._init_modules(init.values())
        return out

    @staticmethod
    def _meta_container(module: nn.Module, stop: set[int]) -> bool:
        """Whether ``module`` holds nothing itself and its subtree is in the unit (no other unit's module
        under it) and holds only meta tensors, so an init of it can only touch the unit's new tensors."""
        tensors = []
        for m in module.modules():
            if id(m) in stop:
                return False
            tensors += [t for t in (*m._parameters.values(), *m._buffers.values()) if t is not None]
        return bool(tensors) and all(t.is_meta for t in tensors)

    def release(self) -> None:
        """Drop the full tensors of the units just built (their parameters now view the shards)."""
        self.held.clear()

    def _init_modules(self, modules: Iterable[nn.Module]) -> None:
        ordered = sorted(modules, key=lambda m: self.post_order.get(id(m), -1))
        for m in ordered:
            for name, buf in m._buffers.items():
                if buf is not None and buf.is_meta:
                    m._buffers[name] = torch.empty_like(buf, device=self.device)
        devices = [self.device.index or 0] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for m in ordered:
                torch.manual_seed(self.seed_for(m))
                if self.param_init_fn is not None:
                    self.param_init_fn(m)
                elif callable(getattr(m, "reset_parameters", None)):
                    m.reset_parameters()
        logger.debug("initialised %d modules: %s", len(ordered), [self.names.get(id(m)) for m in ordered])


def materialize(
    model: nn.Module,
    *,
    device: torch.device | str = "cpu",
    param_init_fn: InitFn | None = None,
    init_seed: int | None = None,
) -> nn.Module:
    """Give a meta-built ``model`` its values in this process, unsharded, as ``shard`` gives them to a
    sharded one (the same values for the same seed, whatever the topology; see [Note: deferred init]).
    No process group needed. Returns ``model``."""
    seed = torch.initial_seed() if init_seed is None else init_seed
    (spec,) = choose_units(model, None)
    DeferredInit(model, torch.device(device), param_init_fn, seed).materialize_specs([spec], ())
    return model
