"""Wrap policies: which modules become communication units, and which parameters each unit owns.

A policy is a set of module classes (every instance becomes a unit) or a callable
``policy(module) -> bool``. The root module is always a unit; a parameter belongs to the nearest
enclosing unit, and a parameter used by modules of two units (tied across units) belongs to the
root unit, which stays gathered for the whole forward and backward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterable, Union

import torch.nn as nn

logger = logging.getLogger(__name__)

__all__ = ["UnitSpec", "WrapPolicy", "plan_units"]

WrapPolicy = Union[Iterable[type], Callable[[nn.Module], bool], None]


@dataclass(frozen=True)
class UnitSpec:
    """One unit to build: its module and the parameters it owns, in ``named_parameters()`` order."""

    name: str
    """Module path of the unit's root ("" for the model)."""
    module: nn.Module
    param_names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    bindings: tuple[tuple[tuple[nn.Module, str], ...], ...]
    """Per parameter, every ``(module, attribute)`` that holds it."""
    aliases: tuple[tuple[str, str], ...]
    """``(alias name, primary name)`` for tied parameters."""


def _predicate(wrap: WrapPolicy) -> Callable[[nn.Module], bool] | None:
    if wrap is None:
        return None
    if callable(wrap) and not isinstance(wrap, type):
        return wrap
    if isinstance(wrap, type):
        wrap = {wrap}
    try:
        classes = tuple(wrap)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(f"wrap must be a set of nn.Module classes or a callable policy; got {wrap!r}") from None
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise ValueError(f"wrap must hold nn.Module classes; got {bad!r}. Pass e.g. wrap={{Block}}")
    if not classes:
        return None
    return lambda m: isinstance(m, classes)


def plan_units(model: nn.Module, wrap: WrapPolicy) -> list[UnitSpec]:
    """Split ``model`` into units; the root unit comes first, the others in module order."""
    predicate = _predicate(wrap)
    modules = list(model.named_modules())
    unit_roots = [(name, m) for name, m in modules[1:] if predicate is not None and predicate(m)]
    if predicate is not None and not unit_roots:
        what = wrap if not callable(wrap) or isinstance(wrap, type) else getattr(wrap, "__name__", repr(wrap))
        found = sorted({type(m).__name__ for _, m in modules[1:]})
        raise ValueError(
            f"wrap policy {what!r} matched no submodule of {type(model).__name__}; the model has {found}. "
            "Pass the classes of the repeated blocks (e.g. wrap={Block}), or wrap=None for one unit"
        )
    unit_index = {id(m): i + 1 for i, (_, m) in enumerate(unit_roots)}
    owner_of_module: dict[int, int] = {}

    def walk(module: nn.Module, current: int) -> None:
        current = unit_index.get(id(module), current)
        if id(module) in owner_of_module:
            return
        owner_of_module[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(model, 0)
    # Every (module, attribute) holding each distinct parameter, in named_parameters() order.
    uses: dict[int, list[tuple[str, nn.Module, str, int]]] = {}
    params: dict[int, nn.Parameter] = {}
    for mod_name, mod in modules:
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            fqn = f"{mod_name}.{attr}" if mod_name else attr
            uses.setdefault(id(p), []).append((fqn, mod, attr, owner_of_module[id(mod)]))
            params[id(p)] = p
    units: list[tuple[str, nn.Module]] = [("", model)] + unit_roots
    owned: list[list[int]] = [[] for _ in units]
    for pid, occurrences in uses.items():
        owners = {u for *_, u in occurrences}
        owned[owners.pop() if len(owners) == 1 else 0].append(pid)
    specs = []
    for (name, module), pids in zip(units, owned):
        aliases = tuple((fqn, uses[pid][0][0]) for pid in pids for fqn, *_ in uses[pid][1:])
        specs.append(
            UnitSpec(
                name=name,
                module=module,
                param_names=tuple(uses[pid][0][0] for pid in pids),
                params=tuple(params[pid] for pid in pids),
                bindings=tuple(tuple((m, a) for _, m, a, _ in uses[pid]) for pid in pids),
                aliases=aliases,
            )
        )
    logger.debug("units: %s", [(s.name or "<root>", len(s.params)) for s in specs])
    return specs
