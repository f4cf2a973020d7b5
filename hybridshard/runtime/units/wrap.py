"""Wrap policies: which modules become communication units, with which strategy, and which
parameters each unit owns.

A policy is one of:

- a set of module classes: every instance becomes a unit with the model's strategy;
- a mapping ``{ModuleClass: strategy}``: every instance becomes a unit with that strategy
  (a :class:`ShardingStrategy`, its name in any case, or ``None`` for the model's strategy). A
  module matches the entry of its own class first, else the first entry (in mapping order) it is an
  instance of;
- a callable ``policy(module)`` returning ``True`` (a unit with the model's strategy), a strategy
  (a unit with that strategy), or ``False`` / ``None`` (not a unit).

The root module is always a unit with the model's strategy; a parameter belongs to the nearest
enclosing unit, and a parameter used by modules of two units (tied across units) belongs to the
root unit, which stays gathered for the whole forward and backward.

[Note: frozen parts]
A unit mixing frozen and trainable parameters (a frozen base ``Linear`` with LoRA adapters) would
build, reduce and keep a gradient for its whole flat buffer. :func:`split_frozen` makes it two units
over the same module: the trainable parameters keep the unit's name; the frozen ones form
``"<name>[frozen]"``, right after it, which builds no gradient and is freed as soon as backward is
done with the module ([Note: resharding frozen units early] in :mod:`hybridshard.runtime.units.unit`).
Both hook the module, in that order, so one call gathers both, a ZeRO-3 forward frees both, and
prefetch depth still counts modules. The split costs one more all-gather per gather, so it is made
only where frozen parameters hold at least ``threshold`` of the unit's elements (``split_frozen``,
0.5 by default: the gradient bytes saved are then at least those still reduced). Names, state dicts
and checkpoints are per parameter and do not see the split; a frozen parameter unfrozen after
``shard`` gets its gradient through its frozen part, whose flat leaf requires grad like every unit's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Mapping, Sequence, Union

import torch.nn as nn

from hybridshard.runtime.units.strategy import ShardingStrategy

logger = logging.getLogger(__name__)

__all__ = ["UnitSpec", "WrapPolicy", "choose_units", "split_frozen"]

StrategyLike = Union[ShardingStrategy, str, None]
WrapPolicy = Union[
    Iterable[type],
    Mapping[type, StrategyLike],
    Callable[[nn.Module], Union[bool, ShardingStrategy, str, None]],
    None,
]


@dataclass(frozen=True)
class UnitSpec:
    """One unit to build: its module, its strategy and the parameters it owns, in ``named_parameters()`` order."""

    name: str
    """Module path of the unit's root ("" for the model)."""
    module: nn.Module
    param_names: tuple[str, ...]
    params: tuple[nn.Parameter, ...]
    bindings: tuple[tuple[tuple[nn.Module, str], ...], ...]
    """Per parameter, every ``(module, attribute)`` that holds it."""
    aliases: tuple[tuple[str, str], ...]
    """``(alias name, primary name)`` for tied parameters."""
    strategy: ShardingStrategy | None = None
    """The unit's own strategy; ``None`` means the model's (always so for the root unit)."""
    part_of: str | None = None
    """For a frozen part, the name of the unit with the same module's trainable parameters; see
    [Note: frozen parts]."""


# A classifier maps a module to (is it a unit, its strategy or None for the model's).
_Classifier = Callable[[str, nn.Module], "tuple[bool, ShardingStrategy | None]"]
_ALLOWED = ", ".join(ShardingStrategy.__members__)


def _parse_strategy(value: StrategyLike, where: str) -> ShardingStrategy | None:
    if value is None:
        return None
    try:
        return ShardingStrategy.parse(value)  # type: ignore[arg-type]
    except ValueError:
        raise ValueError(
            f"{where} must be a ShardingStrategy, one of {_ALLOWED} (any case), or None for the model's "
            f"strategy; got {value!r}"
        ) from None


def _check_classes(classes: Iterable[object]) -> tuple[type, ...]:
    classes = tuple(classes)
    bad = [c for c in classes if not (isinstance(c, type) and issubclass(c, nn.Module))]
    if bad:
        raise ValueError(f"wrap must hold nn.Module classes; got {bad!r}. Pass e.g. wrap={{Block}}")
    return classes  # type: ignore[return-value]


def _from_mapping(wrap: Mapping[type, StrategyLike]) -> _Classifier | None:
    classes = _check_classes(wrap)
    strategies = {c: _parse_strategy(v, f"wrap[{c.__name__}]") for c, v in wrap.items()}
    if not classes:
        return None

    def classify(path: str, module: nn.Module) -> tuple[bool, ShardingStrategy | None]:
        if type(module) in strategies:
            return True, strategies[type(module)]
        for cls in classes:
            if isinstance(module, cls):
                return True, strategies[cls]
        return False, None

    return classify


def _from_callable(policy: Callable[[nn.Module], object]) -> _Classifier:
    def classify(path: str, module: nn.Module) -> tuple[bool, ShardingStrategy | None]:
        verdict = policy(module)
        if isinstance(verdict, (ShardingStrategy, str)):
            where = f"wrap policy result for {path!r} ({type(module).__name__})"
            return True, _parse_strategy(verdict, where)
        return bool(verdict), None

    return classify


def _classifier(wrap: WrapPolicy) -> _Classifier | None:
    if wrap is None:
        return None
    if isinstance(wrap, Mapping):
        return _from_mapping(wrap)
    if callable(wrap) and not isinstance(wrap, type):
        return _from_callable(wrap)
    if isinstance(wrap, type):
        wrap = {wrap}
    try:
        classes = _check_classes(wrap)  # type: ignore[arg-type]
    except TypeError:
        raise ValueError(
            f"wrap must be a set of nn.Module classes, a mapping {{ModuleClass: strategy}} or a callable "
            f"policy; got {wrap!r}"
        ) from None
    if not classes:
        return None
    return lambda path, m: (isinstance(m, classes), None)


def choose_units(model: nn.Module, wrap: WrapPolicy) -> list[UnitSpec]:
    """Split ``model`` into units; the root unit comes first, the others in module order."""
    classify = _classifier(wrap)
    modules = list(model.named_modules())
    unit_roots: list[tuple[str, nn.Module, ShardingStrategy | None]] = []
    if classify is not None:
        for name, m in modules[1:]:
            is_unit, strategy = classify(name, m)
            if is_unit:
                unit_roots.append((name, m, strategy))
    if classify is not None and not unit_roots:
        what = wrap if not callable(wrap) or isinstance(wrap, type) else getattr(wrap, "__name__", repr(wrap))
        found = sorted({type(m).__name__ for _, m in modules[1:]})
        raise ValueError(
            f"wrap policy {what!r} matched no submodule of {type(model).__name__}; the model has {found}. "
            "Pass the classes of the repeated blocks (e.g. wrap={Block}), or wrap=None for one unit"
        )
    unit_index = {id(m): i + 1 for i, (_, m, _) in enumerate(unit_roots)}
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
    units = [("", model, None)] + unit_roots
    owned: list[list[int]] = [[] for _ in units]
    for pid, occurrences in uses.items():
        owners = {u for *_, u in occurrences}
        owned[owners.pop() if len(owners) == 1 else 0].append(pid)
    specs = []
    for (name, module, strategy), pids in zip(units, owned):
        aliases = tuple((fqn, uses[pid][0][0]) for pid in pids for fqn, *_ in uses[pid][1:])
        specs.append(
            UnitSpec(
                name=name,
                module=module,
                param_names=tuple(uses[pid][0][0] for pid in pids),
                params=tuple(params[pid] for pid in pids),
                bindings=tuple(tuple((m, a) for _, m, a, _ in uses[pid]) for pid in pids),
                aliases=aliases,
                strategy=strategy,
            )
        )
    logger.debug("units: %s", [(s.name or "<root>", s.strategy and s.strategy.name, len(s.params)) for s in specs])
    return specs


def split_frozen(specs: Sequence[UnitSpec], threshold: float | None) -> list[UnitSpec]:
    """Split each unit whose frozen parameters hold at least ``threshold`` of its elements (and that has
    trainable ones too) into its trainable and its frozen part; ``None`` splits nothing. See [Note: frozen parts]."""
    out: list[UnitSpec] = []
    for spec in specs:
        frozen = [not p.requires_grad for p in spec.params]
        frozen_numel = sum(p.numel() for p, f in zip(spec.params, frozen) if f)
        total = sum(p.numel() for p in spec.params)
        if threshold is None or all(frozen) or not any(frozen) or frozen_numel < threshold * total:
            out.append(spec)
            continue
        out += [_part(spec, [not f for f in frozen]), _part(spec, frozen, frozen_of=spec.name or "<root>")]
    logger.debug("units after splitting frozen parts: %s", [s.name or "<root>" for s in out])
    return out


def _part(spec: UnitSpec, keep: list[bool], frozen_of: str | None = None) -> UnitSpec:
    names = {n for n, k in zip(spec.param_names, keep) if k}
    pick = lambda values: tuple(v for v, k in zip(values, keep) if k)  # noqa: E731
    return replace(
        spec,
        name=spec.name if frozen_of is None else f"{frozen_of}[frozen]",
        param_names=pick(spec.param_names),
        params=pick(spec.params),
        bindings=pick(spec.bindings),
        aliases=tuple(a for a in spec.aliases if a[1] in names),
        part_of=frozen_of,
    )
