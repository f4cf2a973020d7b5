"""DCP's file-system reader, reading the checkpoint as data and checking what its metadata points at.

:class:`CheckedReader` unpickles ``.metadata`` with the allow-list of [Note: checkpoints are data]
(:mod:`hybridshard.state.trust`), checks its structure (the types DCP writes, every chunk inside
its tensor and backed by a storage entry), keeps every storage entry's file inside the checkpoint
directory, and, before DCP plans any read, checks that each file exists and each entry's offset
and length fit in it. The metadata is read once and reused, so DCP never falls back to reading
rank-local metadata files.
"""

from __future__ import annotations

import logging
import math
import os
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata,
)

from hybridshard.state.trust import UnsafeCheckpointError, is_trusted, load_metadata

logger = logging.getLogger(__name__)

__all__ = ["CheckedReader"]

METADATA_FILE = ".metadata"


class CheckedReader(FileSystemReader):
    """``FileSystemReader`` for a checkpoint that may come from elsewhere; see the module docstring."""

    def __init__(self, path: str | os.PathLike, *, trusted: bool = False) -> None:
        super().__init__(path)
        self.root = os.path.abspath(os.fspath(path))
        self.trusted = is_trusted(trusted)
        self._metadata: Metadata | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise ValueError(f"checkpoint {self.root} has no readable {METADATA_FILE}; rank-local metadata is not read")
        if self._metadata is None:
            if self.trusted:
                logger.warning("reading %s as trusted: pickled objects in it run when loaded", self.root)
            with open(os.path.join(self.root, METADATA_FILE), "rb") as f:
                metadata = load_metadata(f, checkpoint=self.root, file=METADATA_FILE, trusted=self.trusted)
            self._check_structure(metadata)
            if metadata.storage_meta is None:
                metadata.storage_meta = StorageMeta()
            self._metadata = metadata
        self._metadata.storage_meta.load_id = self.load_id
        return self._metadata

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.check_files(metadata)

    # -- checks ------------------------------------------------------------------------------------

    def _malformed(self, what: str) -> ValueError:
        return ValueError(
            f"checkpoint {self.root}: {METADATA_FILE} is malformed ({what}); nothing was read or changed; the "
            "checkpoint is damaged or was edited: load an earlier one (hybridshard.latest_checkpoint)"
        )

    def _check_structure(self, md: Any) -> None:
        """The types DCP writes, chunks inside their tensors, storage for every chunk, files inside the directory."""
        if not isinstance(md, Metadata) or not isinstance(md.state_dict_metadata, dict):
            raise self._malformed(f"a {type(md).__name__} instead of DCP's Metadata")
        if not isinstance(md.storage_data, dict):
            raise self._malformed("no storage entries")
        for key, entry in md.state_dict_metadata.items():
            if not isinstance(key, str):
                raise self._malformed(f"a key of type {type(key).__name__}")
            if isinstance(entry, TensorStorageMetadata):
                self._check_tensor(key, entry)
            elif not isinstance(entry, BytesStorageMetadata):
                raise self._malformed(f"entry {key!r} is a {type(entry).__name__}")
        chunks = {(key, tuple(c.offsets)): c for key, e in md.state_dict_metadata.items()
                  if isinstance(e, TensorStorageMetadata) for c in e.chunks}
        stored = set()
        for index, info in md.storage_data.items():
            if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
                raise self._malformed(f"a storage entry of types {type(index).__name__}, {type(info).__name__}")
            entry = md.state_dict_metadata.get(index.fqn)
            if entry is None:
                raise self._malformed(f"storage for {index.fqn!r}, which the metadata does not list")
            if not (isinstance(info.offset, int) and isinstance(info.length, int) and info.offset >= 0
                    and info.length >= 0 and isinstance(info.relative_path, str)):
                raise self._malformed(f"entry {index.fqn!r}: offset {info.offset!r}, length {info.length!r}")
            if info.transform_descriptors and not all(isinstance(d, str) for d in info.transform_descriptors):
                raise self._malformed(f"entry {index.fqn!r}: transform descriptors {info.transform_descriptors!r}")
            self._check_inside(index.fqn, info.relative_path)
            if isinstance(entry, TensorStorageMetadata):
                offsets = tuple(index.offset) if index.offset is not None else None
                chunk = chunks.get((index.fqn, offsets))
                if chunk is None:
                    raise self._malformed(f"storage for a chunk of {index.fqn!r} at {offsets}, which it does not hold")
                need = math.prod(chunk.sizes) * entry.properties.dtype.itemsize
                if info.length < need and not info.transform_descriptors:
                    raise self._malformed(
                        f"entry {index.fqn!r} at {list(offsets)}: {info.length} bytes stored, {need} needed")
                stored.add((index.fqn, offsets))
            else:
                stored.add((index.fqn, None))
        for key, entry in md.state_dict_metadata.items():
            tensor = isinstance(entry, TensorStorageMetadata)
            wanted = [(key, tuple(c.offsets)) for c in entry.chunks] if tensor else [(key, None)]
            missing = [w for w in wanted if w not in stored]
            if missing:
                raise self._malformed(f"no storage for entry {key!r} at {missing[0][1]}")

    def _check_tensor(self, key: str, entry: TensorStorageMetadata) -> None:
        props, size = entry.properties, entry.size
        if not (isinstance(props, TensorProperties) and isinstance(props.dtype, torch.dtype)):
            raise self._malformed(f"entry {key!r} has properties {props!r}")
        if not isinstance(size, torch.Size) or any(not isinstance(d, int) or d < 0 for d in size):
            raise self._malformed(f"entry {key!r} has size {size!r}")
        if not isinstance(entry.chunks, list):
            raise self._malformed(f"entry {key!r} has chunks {entry.chunks!r}")
        for chunk in entry.chunks:
            if not (isinstance(chunk, ChunkStorageMetadata) and isinstance(chunk.offsets, torch.Size)
                    and isinstance(chunk.sizes, torch.Size) and len(chunk.offsets) == len(size) == len(chunk.sizes)
                    and all(0 <= o and 0 <= s and o + s <= d for o, s, d in zip(chunk.offsets, chunk.sizes, size))):
                raise self._malformed(f"entry {key!r} of size {list(size)} has a chunk {chunk!r} outside it")

    def _check_inside(self, key: str, relative: str) -> None:
        base = os.path.realpath(self.root)
        target = os.path.realpath(os.path.join(self.root, relative))
        if os.path.isabs(relative) or os.path.commonpath([base, target]) != base or target == base:
            raise UnsafeCheckpointError(
                f"refused checkpoint {self.root}: entry {key!r} is stored in {relative!r}, which is outside the "
                "checkpoint directory; nothing was read or changed (model and optimizer untouched)"
            )

    def check_files(self, metadata: Metadata) -> None:
        """``ValueError`` unless every storage entry's file exists and its offset and length fit the file."""
        sizes: dict[str, int] = {}
        for index, info in metadata.storage_data.items():
            if info.relative_path not in sizes:
                path = os.path.join(self.root, info.relative_path)
                if not os.path.isfile(path):
                    raise ValueError(
                        f"checkpoint {self.root}: entry {index.fqn!r} is stored in {info.relative_path}, which is "
                        "missing; nothing was read or changed: load an earlier checkpoint (hybridshard.latest_checkpoint)"
                    )
                sizes[info.relative_path] = os.path.getsize(path)
            if info.offset + info.length > sizes[info.relative_path]:
                raise ValueError(
                    f"checkpoint {self.root}: entry {index.fqn!r} lies at bytes [{info.offset}, "
                    f"{info.offset + info.length}) of {info.relative_path}, which holds {sizes[info.relative_path]}; "
                    "the file is truncated or was edited: load an earlier checkpoint (hybridshard.latest_checkpoint)"
                )
