"""Sharded checkpoints on ``torch.distributed.checkpoint`` (DCP) that load onto any topology.

    hs.save_checkpoint(path, model, optimizer=opt, extra={"step": step})   # collective
    extra = hs.load_checkpoint(path, model, optimizer=opt)                  # collective (or one plain process)

[Note: checkpoint format]
A checkpoint is a directory DCP wrote (``.metadata`` plus ``__<rank>_<n>.distcp`` files) and
``hybridshard.json`` (the manifest: strategy and groups it was saved with, parameter names,
shapes and dtypes, tied names, optimizer keys, bytes each rank wrote). DCP keys follow
``torch.distributed.checkpoint.state_dict``: ``model.<name>`` for every parameter (under its own
name and full shape, tied ones once, under their first name) and persistent buffer,
``optim.state.<name>.<key>`` for optimizer state, ``optim.param_groups`` (hyperparameters and
parameter names) and ``extra`` (the caller's object). Parameters and per-element optimizer state
are written as boxes of the rank's flat shard; see [Note: flat pieces as DCP chunks] and
[Note: replicas split the writing].

[Note: atomic publish]
Every rank writes into ``<path>.partial``; after DCP wrote its metadata, rank 0 adds the manifest,
waits for every rank (barrier), and renames the directory to ``<path>``. A save that dies before
that leaves ``<path>.partial`` and no ``<path>``, so the previous checkpoint stays the newest
complete one (:func:`latest_checkpoint` ignores ``.partial``). Overwriting an existing ``<path>``
moves it to ``<path>.old`` first and deletes it after the rename; a crash between the two renames
leaves ``<path>.old``, which :func:`load_checkpoint` falls back to.

Loading reads the checkpoint as data: see [Note: checkpoints are data] in
:mod:`hybridshard.state.trust` and :class:`hybridshard.state.reader.CheckedReader`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from hybridshard.runtime.engine import get_engine
from hybridshard.state import optim as O
from hybridshard.state.access import (
    check_idle, gather_slices, is_sharded, local_params, module_state_dict, param_ranges, units,
)
from hybridshard.runtime.trace.position import api_call
from hybridshard.state.matching import check_model, check_state_size
from hybridshard.state.pieces import Piece, PieceLoadPlanner, PieceSavePlanner
from hybridshard.state.progress import ProgressWriter
from hybridshard.state.reader import CheckedReader
from hybridshard.state.save_meta import exchange as exchange_meta
from hybridshard.state.trust import UnsafeCheckpointError, check_plain

logger = logging.getLogger(__name__)

__all__ = ["SaveResult", "latest_checkpoint", "load_checkpoint", "read_manifest", "save_checkpoint"]

MANIFEST = "hybridshard.json"
FORMAT_VERSION = 1
_PARTIAL, _OLD = ".partial", ".old"


@dataclass(frozen=True)
class SaveResult:
    """What one :func:`save_checkpoint` call wrote."""

    path: str
    bytes_per_rank: tuple[int, ...]
    """Bytes of ``.distcp`` files each rank wrote."""
    seconds: float


# -- what each rank holds --------------------------------------------------------------------------


def _aliases(model: nn.Module) -> list[tuple[str, str]]:
    if is_sharded(model):
        return [a for unit in units(model) for a in unit.flat.layout.aliases]
    first: dict[int, str] = {}
    out = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            out.append((name, first[id(p)]))  # tied: stored once, under its first name
        else:
            first[id(p)] = name
    return out


def _buffers(model: nn.Module, param_names: set[str]) -> dict[str, torch.Tensor]:
    aliases = {a for a, _ in _aliases(model)}
    return {k: v for k, v in module_state_dict(model).items() if k not in param_names and k not in aliases}


def _node() -> str:
    return os.environ.get("HYBRIDSHARD_NODE_NAME") or socket.gethostname()


def _topology(model: nn.Module, nodes: list[str]) -> dict[str, Any]:
    if not is_sharded(model):
        return {"world_size": 1, "strategy": None, "nodes": nodes, "units": []}
    engine = get_engine(model)
    units = [
        {"name": u.name, "strategy": u.strategy.name, "shard_size": u.groups.shard_size,
         "replicate_size": u.groups.replicate_size, "numel": u.flat.layout.numel}
        for u in engine.units
    ]
    return {"world_size": dist.get_world_size(), "strategy": engine.strategy.name, "nodes": nodes, "units": units}


# -- save ------------------------------------------------------------------------------------------


@api_call
def save_checkpoint(
    path: str | os.PathLike, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None, extra: Any = None
) -> SaveResult:
    """Write ``model`` (and ``optimizer``'s state, and ``extra``) to the directory ``path``.

    Collective for a sharded model (every rank calls it with the same path); a plain model saves
    from one process. Each rank writes only its shard, replicas split their shard between them,
    and ``path`` appears only once complete. See [Note: checkpoint format] and [Note: atomic publish].
    """
    t0 = time.perf_counter()
    sharded = is_sharded(model)
    rank = dist.get_rank() if sharded else 0
    if sharded:
        check_idle(model, "save_checkpoint")
        for unit in units(model):
            unit.flat.writeback_params()
    final = os.path.abspath(os.fspath(path))
    partial = final + _PARTIAL
    places = param_ranges(model, replica_split=True)
    local = local_params(model)
    pieces: dict[str, list[Piece]] = {}
    plain: dict[str, Any] = {}
    params = {name: (p.detach().reshape(-1) if not sharded else p.data) for name, p in local.items()}
    for name, (shape, start, numel, at) in places.items():
        pieces[f"model.{name}"] = [Piece(shape, start, params[name][at : at + numel])] if numel else []
    for key, value in _buffers(model, set(places)).items():
        plain[f"model.{key}"] = value.detach()
    manifest_optim = None
    if optimizer is not None:
        groups = [{**hyper, "params": names} for hyper, names in O.named_groups(model, optimizer)]
        plain["optim.param_groups"] = groups
        per_element: dict[str, list[str]] = {}
        for name, entry in O.named_state(model, optimizer).items():
            shape, start, numel, at = places[name]
            for key, value in entry.items():
                fqn = f"optim.state.{name}.{key}"
                if O.is_per_element(key, value, local[name].shape, len(shape)):
                    flat = value.detach().reshape(-1)
                    pieces[fqn] = [Piece(shape, start, flat[at : at + numel])] if numel else []
                    per_element.setdefault(name, []).append(key)
                else:
                    plain[fqn] = value.detach() if torch.is_tensor(value) else value
        manifest_optim = {"class": type(optimizer).__name__, "num_groups": len(groups), "per_element": per_element}
    if extra is not None:
        plain["extra"] = extra
    for key, value in plain.items():  # read back with weights_only=True; see [Note: checkpoints are data]
        if not torch.is_tensor(value):
            check_plain(value, key)

    if rank == 0:
        os.makedirs(os.path.dirname(final), exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # a save that died earlier
        os.makedirs(partial)
    if sharded:
        dist.barrier()
    planner = PieceSavePlanner(pieces)
    writer = ProgressWriter(partial, label=final, rank=rank, single_file_per_rank=True, sync_files=True,
                            overwrite=False)
    logger.info("save %s: rank %d writing %d sharded keys and %d whole entries", final, rank, len(pieces), len(plain))
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.save(plain, storage_writer=writer, planner=planner, no_dist=not sharded)
        except CheckpointException as exc:
            raise _unwrap(exc, f"save_checkpoint({final})") from None
    written = writer.bytes_written
    seconds = time.perf_counter() - t0
    logger.info("save %s: rank %d wrote %d bytes in %.2f s", final, rank, written, seconds)
    nodes, per_rank = exchange_meta(_node(), written) if sharded else ([_node()], [written])
    if rank == 0:
        assert nodes is not None
        topology = _topology(model, nodes)
        shapes = {name: list(shape) for name, (shape, _, _, _) in places.items()}
        dtypes = {name: str(p.dtype) for name, p in local.items()}
        manifest = {
            "format": FORMAT_VERSION, "torch": torch.__version__, "created": time.time(), **topology,
            "params": {n: {"shape": shapes[n], "dtype": dtypes[n]} for n in shapes},
            "aliases": _aliases(model), "buffers": sorted(k[len("model."):] for k in plain if k.startswith("model.")),
            "optimizer": manifest_optim, "extra": extra is not None, "bytes_per_rank": per_rank,
        }
        _write_json(os.path.join(partial, MANIFEST), manifest)
    if sharded:
        dist.barrier()  # every rank finished writing before the directory is published
    if rank == 0:
        _publish(partial, final)
        logger.info("saved %s: %d bytes from %d ranks in %.2f s", final, sum(per_rank), len(per_rank), seconds)
    if sharded:
        dist.barrier()  # nobody returns (and, say, loads) before the directory is there
    return SaveResult(final, tuple(per_rank), time.perf_counter() - t0)


def _unwrap(exc: CheckpointException, what: str) -> Exception:
    """DCP's ``CheckpointException`` (a ``BaseException``) as the first rank's own error type and message."""
    rank, (first, _) = min(exc.failures.items(), key=lambda kv: kv[0])
    if isinstance(first, UnsafeCheckpointError):
        return UnsafeCheckpointError(str(first))  # its first line says it all
    kind = ValueError if isinstance(first, ValueError) else RuntimeError
    return kind(f"{what} failed on rank {rank}: {first}")


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, default=str)
        f.flush()
        os.fsync(f.fileno())


def _publish(partial: str, final: str) -> None:
    """Rename ``partial`` to ``final``; see [Note: atomic publish]."""
    old = final + _OLD
    if os.path.exists(final):
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(partial, final)
    shutil.rmtree(old, ignore_errors=True)
    fd = os.open(os.path.dirname(final), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def latest_checkpoint(directory: str | os.PathLike) -> str | None:
    """The complete checkpoint under ``directory`` whose name sorts last (``None`` if there is none).

    Name checkpoints so that they sort by step (``step_00000100``). ``.partial`` directories
    (saves that did not finish) are ignored.
    """
    directory = os.fspath(directory)
    if not os.path.isdir(directory):
        return None
    found = {}
    for name in os.listdir(directory):
        if name.endswith(_PARTIAL) or not os.path.isfile(os.path.join(directory, name, MANIFEST)):
            continue
        base = name[: -len(_OLD)] if name.endswith(_OLD) else name  # see [Note: atomic publish]
        if base not in found or name == base:
            found[base] = name
    return os.path.join(directory, found[max(found)]) if found else None


# -- load ------------------------------------------------------------------------------------------


def read_manifest(path: str | os.PathLike) -> dict[str, Any]:
    """The manifest of the checkpoint at ``path``; ``ValueError`` if ``path`` is not a complete checkpoint."""
    path = _resolve(os.fspath(path))
    try:
        with open(os.path.join(path, MANIFEST), encoding="utf-8") as f:
            manifest = json.load(f)
    except ValueError as exc:  # not JSON (json never runs code: nothing was executed)
        raise ValueError(
            f"checkpoint {path}: {MANIFEST} is not JSON ({exc}); the checkpoint is damaged or was edited: load an "
            "earlier one (hybridshard.latest_checkpoint)"
        ) from None
    if not isinstance(manifest, dict):
        raise ValueError(f"checkpoint {path}: {MANIFEST} holds a {type(manifest).__name__}, expected a JSON object")
    return manifest


def _resolve(path: str) -> str:
    if os.path.isfile(os.path.join(path, MANIFEST)):
        return path
    if os.path.isfile(os.path.join(path + _OLD, MANIFEST)):
        logger.warning("%s is missing but %s%s is complete (a save died while publishing): using it", path, path, _OLD)
        return path + _OLD
    hint = f"; {path}{_PARTIAL} is a save that did not finish" if os.path.isdir(path + _PARTIAL) else ""
    raise ValueError(
        f"no complete checkpoint at {path} (expected a directory with {MANIFEST}){hint}; pass a directory "
        "save_checkpoint wrote, e.g. hybridshard.latest_checkpoint(checkpoint_dir)"
    )


@api_call
def load_checkpoint(
    path: str | os.PathLike, model: nn.Module, *, optimizer: torch.optim.Optimizer | None = None,
    trusted: bool = False,
) -> Any:
    """Load the checkpoint at ``path`` into ``model`` (and ``optimizer``); return the saved ``extra``.

    Any topology and strategy: each rank reads the parts of each parameter it now holds, whatever
    layout wrote them. Collective for a sharded model; a plain model loads in one process without
    a process group. Names, shapes and optimizer groups are checked first, and every value is read
    into fresh buffers before anything is copied, so an error leaves model and optimizer unchanged.

    The checkpoint is read as data (see [Note: checkpoints are data]): a pickled object outside the
    allow-lists raises :class:`~hybridshard.state.trust.UnsafeCheckpointError` before it runs.
    ``trusted=True`` (or ``HYBRIDSHARD_TRUST_CHECKPOINTS=1``) reads it with full pickle, as DCP does.
    """
    path = _resolve(os.path.abspath(os.fspath(path)))
    sharded = is_sharded(model)
    if sharded:
        check_idle(model, "load_checkpoint")
    reader = CheckedReader(path, trusted=trusted)
    stored = reader.read_metadata().state_dict_metadata
    manifest = read_manifest(path)
    places = param_ranges(model)
    local = local_params(model)
    buffers = _buffers(model, set(places))
    check_model(path, stored, places, buffers)
    if optimizer is not None:
        if manifest.get("optimizer") is None:
            raise ValueError(f"{path} holds no optimizer state (saved without optimizer=); load it without optimizer=")
        saved_groups = read_entries(reader, ["optim.param_groups"], what=f"load_checkpoint({path})")
        O.check_groups(model, optimizer, saved_groups["optim.param_groups"])

    pieces: dict[str, list[Piece]] = {}
    plain: dict[str, Any] = {}
    targets: dict[str, torch.Tensor] = {}
    for name, (shape, start, numel, _) in places.items():
        buf = torch.empty(numel, dtype=stored[f"model.{name}"].properties.dtype)
        pieces[f"model.{name}"] = [Piece(shape, start, buf)] if numel else []
        targets[name] = buf
    for key, value in buffers.items():
        plain[f"model.{key}"] = torch.empty_like(value, device="cpu")
    if optimizer is not None:
        plain["optim.param_groups"] = None
        per_element = manifest["optimizer"]["per_element"]
        for fqn, md in stored.items():
            if not fqn.startswith("optim.state."):
                continue
            name, key = fqn[len("optim.state."):].rsplit(".", 1)
            if name not in places:
                raise ValueError(f"{path} has optimizer state for {name!r}, which this model lacks")
            shape, start, numel, _ = places[name]
            check_state_size(path, fqn, md, shape, per_element=key in per_element.get(name, []))
            if key in per_element.get(name, []):
                pieces[fqn] = [Piece(shape, start, torch.empty(numel, dtype=md.properties.dtype))] if numel else []
                targets[fqn] = pieces[fqn][0].flat if numel else torch.empty(0, dtype=md.properties.dtype)
            else:
                plain[fqn] = torch.empty(md.size, dtype=md.properties.dtype) if isinstance(md, TensorStorageMetadata) else None
    if "extra" in stored:
        plain["extra"] = None
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            planner = PieceLoadPlanner(pieces, checkpoint=path, trusted=reader.trusted)
            dcp.load(plain, storage_reader=reader, planner=planner, no_dist=not sharded)
        except CheckpointException as exc:
            raise _unwrap(exc, f"load_checkpoint({path})") from None
    logger.info("load %s: read in %.2f s", path, time.perf_counter() - t0)

    # Everything is read: now change the model and the optimizer.
    with torch.no_grad():
        if sharded:  # into the master shard; every parameter points at it again afterwards
            for unit in units(model):
                for i, slot in enumerate(unit.flat.layout.slots):
                    unit.flat.shard_view(i).copy_(targets[slot.name])
                unit.flat.use_sharded_params()
            gather_slices(model)  # the replicas' slices, when the optimizer is sharded across them
        else:
            for name, p in local.items():
                p.data.copy_(targets[name].view(p.shape))
        for key, value in buffers.items():
            value.copy_(plain[f"model.{key}"])
    if optimizer is not None:
        state: dict[str, dict[str, Any]] = {}
        for fqn in list(plain) + [k for k in targets if k.startswith("optim.state.")]:
            if not fqn.startswith("optim.state."):
                continue
            name, key = fqn[len("optim.state."):].rsplit(".", 1)
            value = targets[fqn].view(local[name].shape) if fqn in targets else plain[fqn]
            state.setdefault(name, {})[key] = value
        O.apply_state(model, optimizer, plain["optim.param_groups"], state)
    return plain.get("extra")


def read_extra(path: str | os.PathLike, *, trusted: bool = False) -> Any:
    """The ``extra`` the checkpoint at ``path`` was saved with (``None`` if none), read on its own: no
    model, no process group, so a caller can check it before :func:`load_checkpoint` changes anything.
    Read as data, as :func:`load_checkpoint` reads it (``trusted`` as there)."""
    path = _resolve(os.path.abspath(os.fspath(path)))
    reader = CheckedReader(path, trusted=trusted)
    if "extra" not in reader.read_metadata().state_dict_metadata:
        return None
    return read_entries(reader, ["extra"], what=f"read_extra({path})")["extra"]


def read_entries(reader: CheckedReader, keys: list[str], *, what: str) -> dict[str, Any]:
    """Bytes entries (small: hyperparameters, ``extra``), read on their own so they can be checked first."""
    out: dict[str, Any] = dict.fromkeys(keys)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        try:
            dcp.load(out, storage_reader=reader, planner=PieceLoadPlanner({}, checkpoint=reader.root,
                                                                          trusted=reader.trusted), no_dist=True)
        except CheckpointException as exc:
            raise _unwrap(exc, what) from None
    return out
