"""``shard(..., compile=...)``: ``torch.compile`` of each unit's module, the runtime's hooks left outside.

[Note: compiling units]
``nn.Module.compile()`` compiles the module's ``_call_impl``, so the forward pre-/post-hooks the
runtime registers on every unit (see [Note: hook wiring] in :mod:`hybridshard.runtime.engine`) run
inside the compiled call. Dynamo then traces the hooks' Python state machine (gathers, collectives,
state enums): it breaks the graph at each unit and guards on the state it read, so frames pile up
and steps recompile. Instead ``shard`` replaces each compiled unit's ``forward`` (an instance
attribute, which ``_call_impl`` calls) by ``torch.compile`` of it: the hooks run eagerly around
the compiled forward, the gather is done before it starts and the views are installed, and the
compiled region reads the views from the module's parameter tables as graph inputs. The views are
new tensors each step but of the same shape, dtype and strides, views of the same flat leaf, so
dynamo's tensor guards hold and nothing recompiles; autograd runs through them into the flat
gradient as in eager mode. Blocks of one class share their code and compile once.

Which units: every unit whose module holds no other unit's module (the blocks). A module holding
other units, in practice the root (the model: embeddings, final norm, head, and the loop over the
blocks), stays eager, since compiling it would trace the inner units' hooks again; its forward
calls the compiled blocks. A frozen part split off a module shares the module: compiled once.
Compiling the whole model yourself (``torch.compile(model)``) traces every hook and is not
supported; compile through ``shard``.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Sequence

import torch
import torch.nn as nn

logger = logging.getLogger(__name__)

__all__ = ["parse_compile", "compile_units"]


def parse_compile(value: Any) -> dict[str, Any] | None:
    """``compile=`` of :func:`hybridshard.shard` as ``torch.compile`` keyword arguments, or ``None`` (eager)."""
    if value is None or value is False:
        return None
    if value is True:
        return {}
    if not isinstance(value, dict):
        raise ValueError(
            f"compile must be True, False or a dict of torch.compile keyword arguments (e.g. "
            f"{{'mode': 'max-autotune'}}); got {value!r}"
        )
    accepted = [n for n, p in inspect.signature(torch.compile).parameters.items()
                if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(k for k in value if k not in accepted)
    if unknown:
        raise ValueError(
            f"compile={value!r}: torch.compile accepts the keywords {accepted}, found {unknown}; drop or rename them"
        )
    return dict(value)


def compile_units(units: Sequence[Any], options: dict[str, Any]) -> list[str]:
    """Compile the forward of every unit that holds no other unit; the names compiled. See [Note: compiling units]."""
    modules: dict[int, tuple[str, nn.Module]] = {}
    for unit in units:
        modules.setdefault(id(unit.module), (unit.name, unit.module))
    compiled = []
    for name, module in modules.values():
        if any(id(m) in modules for m in module.modules() if m is not module):
            logger.debug("compile: %s holds other units and stays eager", name)
            continue
        # ``module.forward`` as the module has it (a forward a library set on the instance included).
        module.forward = torch.compile(module.forward, **options)
        compiled.append(name)
    logger.info("compiled %d of %d modules with units: %s", len(compiled), len(modules), compiled)
    return compiled
