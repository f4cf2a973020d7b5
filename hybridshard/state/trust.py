"""Reading a checkpoint as data: the allow-listed unpicklers, the refusal, and the plain-value check at save.

[Note: checkpoints are data]
A DCP checkpoint holds pickles in two places: ``.metadata`` (DCP's ``FileSystemReader`` reads it
with ``pickle.load``) and every bytes entry (``extra``, ``optim.param_groups``, an optimizer's
non-tensor state; DCP's default planner reads them with ``torch.load(weights_only=False)``). A
pickle names the callables it calls while loading, so a checkpoint from elsewhere could run any
code. Here both are read with allow-lists, and a name outside them stops the load before anything
is called or changed:

- ``.metadata``: exactly what DCP writes there, traced on real saves: the dataclasses of
  ``torch.distributed.checkpoint.metadata``, ``_StorageInfo``, ``torch.Size``, dtypes, layouts
  (``torch.serialization._get_layout``), memory formats (``_MEM_FORMAT_ENCODING``) and the path
  type of ``StorageMeta.checkpoint_id``.
- bytes entries: ``torch.load(weights_only=True)``, with nothing added to its allow-list: the values
  this package writes there are plain (see :func:`check_plain`, run on every such value at save).

``trusted=True`` or ``HYBRIDSHARD_TRUST_CHECKPOINTS=1`` reads both as DCP does (full pickle).
"""

from __future__ import annotations

import io
import logging
import os
import pathlib
import pickle
import re
import zipfile
from collections import OrderedDict
from typing import IO, Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_fs
import torch.distributed.checkpoint.metadata as dcp_md
import torch.serialization

logger = logging.getLogger(__name__)

__all__ = ["TRUST_ENV", "UnsafeCheckpointError", "check_plain", "is_trusted", "load_bytes", "load_metadata"]

TRUST_ENV = "HYBRIDSHARD_TRUST_CHECKPOINTS"
"""Set to ``1`` to read every checkpoint as ``trusted=True`` (full pickle, as DCP does)."""


class UnsafeCheckpointError(ValueError):
    """A checkpoint holds a pickled object outside the allow-lists; nothing from it ran, nothing changed."""


def is_trusted(trusted: bool = False) -> bool:
    """``trusted``, or ``HYBRIDSHARD_TRUST_CHECKPOINTS`` set to 1/true/yes."""
    return bool(trusted) or os.environ.get(TRUST_ENV, "").strip().lower() in ("1", "true", "yes")


def refusal(checkpoint: str, where: str, found: str) -> str:
    """The refusal's one line: which file and entry, what it tried to load, and the way out."""
    return (
        f"refused checkpoint {checkpoint}: {where} tries to load {found}, which is not allow-listed "
        "(pickled objects can run code); nothing from it was executed and nothing was changed (model and optimizer "
        f"untouched); if you trust this checkpoint, pass trusted=True or set {TRUST_ENV}=1"
    )


# -- .metadata ---------------------------------------------------------------------------------------


def _metadata_globals() -> dict[tuple[str, str], Any]:
    md = "torch.distributed.checkpoint.metadata"
    allowed: dict[tuple[str, str], Any] = {
        (md, name): getattr(dcp_md, name)
        for name in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
                     "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    }
    allowed[("torch.distributed.checkpoint.filesystem", "_StorageInfo")] = dcp_fs._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout  # a lookup by name
    for name, value in vars(torch).items():
        if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
            allowed[("torch", name)] = value
    for cls in (pathlib.PosixPath, pathlib.PurePosixPath, pathlib.WindowsPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = cls
        allowed[(cls.__module__, cls.__name__)] = cls  # pathlib._local on newer Pythons
    return allowed


_METADATA_GLOBALS = _metadata_globals()


class _Refused(pickle.UnpicklingError):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle.Unpickler`` whose globals are the allow-list of [Note: checkpoints are data]."""

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _METADATA_GLOBALS[(module, name)]
        except KeyError:
            raise _Refused(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> Any:
        raise _Refused(f"a persistent id ({type(pid).__name__})")


def load_metadata(stream: IO[bytes], *, checkpoint: str, file: str, trusted: bool) -> Any:
    """Unpickle DCP's ``.metadata`` from ``stream`` with the allow-list (``pickle.load`` when ``trusted``)."""
    if trusted:
        return pickle.load(stream)
    try:
        return _MetadataUnpickler(stream).load()
    except _Refused as exc:
        raise UnsafeCheckpointError(refusal(checkpoint, f"{file} (DCP's metadata)", exc.name)) from None
    except Exception as exc:  # noqa: BLE001 - any other failure is a file that is not DCP metadata
        raise ValueError(
            f"checkpoint {checkpoint}: {file} is not DCP metadata ({type(exc).__name__}: {exc}); the checkpoint is "
            "damaged: load an earlier one (hybridshard.latest_checkpoint)"
        ) from None


# -- bytes entries -----------------------------------------------------------------------------------

_GLOBAL_IN_MESSAGE = re.compile(r"GLOBAL (\S+) was not an allowed global")


def load_bytes(data: bytes, *, checkpoint: str, file: str, entry: str, trusted: bool) -> Any:
    """A bytes entry (a ``torch.save`` stream) read with ``torch.load(weights_only=True)``.

    Before loading, the pickle's globals are listed statically (``torch.serialization.
    get_unsafe_globals_in_checkpoint``), so the refusal names every class it would load."""
    if trusted:
        return torch.load(io.BytesIO(data), weights_only=False)
    if zipfile.is_zipfile(io.BytesIO(data)):
        try:
            unsafe = sorted(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data)))
        except Exception:  # noqa: BLE001 - listing is for the message only; weights_only below decides
            unsafe = []
        if unsafe:
            raise UnsafeCheckpointError(refusal(checkpoint, f"{file}, entry {entry!r},", ", ".join(unsafe)))
    try:
        return torch.load(io.BytesIO(data), weights_only=True)
    except pickle.UnpicklingError as exc:
        found = _GLOBAL_IN_MESSAGE.search(str(exc))
        what = found.group(1) if found else f"an object the weights-only unpickler rejects ({_reason(exc)})"
        raise UnsafeCheckpointError(refusal(checkpoint, f"{file}, entry {entry!r},", what)) from None
    except Exception as exc:  # noqa: BLE001 - not a torch.save stream at all
        raise ValueError(
            f"checkpoint {checkpoint}: {file}, entry {entry!r}, is not a torch.save stream ({type(exc).__name__}: "
            f"{_reason(exc)}); the checkpoint is damaged or was edited: load an earlier one"
        ) from None


def _reason(exc: BaseException) -> str:
    """The line of torch's weights-only message that says what was rejected."""
    found = re.search(r"WeightsUnpickler error: (.*)", str(exc))
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return found.group(1).strip() if found else (lines[0] if lines else type(exc).__name__)


# -- plain values at save ----------------------------------------------------------------------------

_CONTAINERS = (dict, OrderedDict, list, tuple, set)


def _round_trips(value: Any) -> bool:
    buf = io.BytesIO()
    try:
        torch.save(value, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 - anything torch.save or the weights-only load refuses
        return False
    return True


def _first_unplain(value: Any, path: str) -> tuple[str, Any] | None:
    if type(value) in _CONTAINERS:
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            if isinstance(value, dict) and not _round_trips(key):
                return f"{path} (the key {key!r})", key
            found = _first_unplain(item, f"{path}[{key!r}]")
            if found:
                return found
        return None
    return None if _round_trips(value) else (path, value)


def check_plain(value: Any, name: str) -> None:
    """``ValueError`` naming the key path and type of the first value in ``value`` that
    ``torch.load(weights_only=True)`` would not read back (checked by a round trip)."""
    if _round_trips(value):
        return
    path, bad = _first_unplain(value, name) or (name, value)
    kind = f"{type(bad).__module__}.{type(bad).__qualname__}"
    raise ValueError(
        f"{path} is of type {kind}, which a checkpoint does not store: expected plain values that "
        "torch.load(weights_only=True) reads back (None, bool, int, float, str, bytes, tensors, torch dtypes and "
        "Size, and dicts, lists, tuples and sets of them); convert it before saving (dict(x), vars(namespace), "
        "str(path), x.item() for a numpy scalar, torch.from_numpy(array))"
    )
