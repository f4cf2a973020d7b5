"""A sharded model's own ``state_dict()`` / ``load_state_dict()``: they raise instead of lying.

[Note: a state dict that cannot lie]
Between steps every parameter of a sharded model holds, as ``.data``, a 1-D slice of its unit's
master shard ([Note: two kinds of views]). The module's own ``state_dict()`` would return those
slices under the full names (``torch.save``, ``save_pretrained`` or DCP would write them where full
tensors belong), and ``load_state_dict`` of a full state dict would fail on shapes or copy the wrong
elements. So ``shard`` makes both raise a ``ValueError`` on the model and every submodule, naming
:func:`hybridshard.full_state_dict`, :func:`hybridshard.load_full_state_dict`,
:func:`hybridshard.save_checkpoint` / :func:`hybridshard.load_checkpoint` and
:func:`hybridshard.save_pretrained`. It raises rather than gathers (FSDP1's default) because a
gathering ``state_dict()`` is a collective, most often called on rank 0 only, which would hang.

``torch.distributed.checkpoint.state_dict``'s four functions walk parameters by name and never call
the model's ``state_dict()``, but ask the root's ``_fqn_modifiers()`` for renamed keys: ``shard``
gives the root one that raises the same ``ValueError``, so they raise before reading anything. The
runtime's own state code reads through :func:`module_state_dict`, which lets the call through on
this thread.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any, Iterator

import torch.nn as nn

logger = logging.getLogger(__name__)

__all__ = ["guard_state_dict", "module_state_dict", "state_dict_error"]

_LOCAL = threading.local()


def state_dict_error(what: str, model_name: str) -> str:
    return (
        f"{what} is refused on a sharded {model_name}: between steps each parameter holds this rank's 1-D "
        "slice, which it would save or load under the full names; use hybridshard.full_state_dict(model) / "
        "hybridshard.load_full_state_dict(model, sd) (full tensors, collective), hybridshard.save_checkpoint / "
        "hybridshard.load_checkpoint (sharded, any topology), or hybridshard.save_pretrained(model, dir) "
        "(safetensors for from_pretrained)\n"
        "See [Note: a state dict that cannot lie] in hybridshard/runtime/setup/state_guard.py."
    )


@contextlib.contextmanager
def _allowed() -> Iterator[None]:
    before = getattr(_LOCAL, "allowed", False)
    _LOCAL.allowed = True
    try:
        yield
    finally:
        _LOCAL.allowed = before


def module_state_dict(model: nn.Module, *, keep_vars: bool = False) -> dict[str, Any]:
    """``model.state_dict(keep_vars=...)`` as torch builds it (sharded slices included), for the
    runtime's own state code."""
    with _allowed():
        return model.state_dict(keep_vars=keep_vars)


def guard_state_dict(model: nn.Module) -> None:
    """Make ``state_dict()`` / ``load_state_dict()`` on ``model`` and its submodules and the
    ``torch.distributed.checkpoint.state_dict`` functions raise; see [Note: a state dict that cannot lie]."""
    name = type(model).__name__

    def refuse_save(module: nn.Module, prefix: str, keep_vars: bool) -> None:
        if not getattr(_LOCAL, "allowed", False):
            raise ValueError(state_dict_error(f"{type(module).__name__}.state_dict()", name))

    def refuse_load(module: nn.Module, *args: Any, **kwargs: Any) -> None:
        raise ValueError(state_dict_error(f"{type(module).__name__}.load_state_dict()", name))

    def refuse_dcp() -> dict[str, str]:
        raise ValueError(state_dict_error("torch.distributed.checkpoint.state_dict's get/set_*_state_dict", name))

    for module in model.modules():
        module.register_state_dict_pre_hook(refuse_save)
        module.register_load_state_dict_pre_hook(refuse_load)
    if "_fqn_modifiers" in model.__dict__ or hasattr(type(model), "_fqn_modifiers"):
        logger.debug("%s defines _fqn_modifiers; the torch.distributed.checkpoint functions are not guarded", name)
    else:
        model.__dict__["_fqn_modifiers"] = refuse_dcp
