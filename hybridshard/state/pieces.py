"""Which pieces of each parameter a rank writes and reads, and the DCP planners that move them.

Pure arithmetic (flat ranges -> boxes, the replica split) plus two small subclasses of
``torch.distributed.checkpoint``'s default planners. Knows nothing about models or optimizers:
:mod:`hybridshard.state.checkpoint` hands it ``{key: [Piece, ...]}``.

[Note: flat pieces as DCP chunks]
A rank's part of a parameter is a contiguous range ``[start, end)`` of the parameter *flattened*
(see [Note: flat layout]). DCP describes a stored tensor by its full shape and a list of chunks,
each an N-d box (offsets, sizes). A flat range of a row-major tensor is a union of at most
``2 * ndim - 1`` boxes: a partial first row (recursively), a block of full rows, a partial last
row (recursively); every such box is itself contiguous in the flattened order, so its data is a
plain slice of the rank's flat storage viewed with the box's sizes. Stored this way a checkpoint
has each parameter under its own name and shape, as an unsharded model's ``state_dict`` would, and
DCP's own resharding (overlap of saved boxes with the boxes a loading rank asks for) maps it onto
any other layout: another shard size, another strategy, or one plain process.

[Note: replicas split the writing]
Every member of a replicate group holds the same shard. Replica ``r`` of ``R`` writes only the
``r``-th of ``R`` nearly equal consecutive parts of the shard, so the group writes each element
once and the bytes are spread over all ranks. Tensors that are the same on every rank (buffers, an
optimizer's step count, hyperparameters) are left to DCP's own de-duplication: every rank offers
them, and the global planner keeps one writer per key.
"""

from __future__ import annotations

import dataclasses
import io
import math
from dataclasses import dataclass
from typing import Sequence

import torch
from torch.distributed.checkpoint import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import LoadPlan, ReadItem, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from hybridshard.state.trust import is_trusted, load_bytes

__all__ = ["Box", "Piece", "PieceLoadPlanner", "PieceSavePlanner", "flat_range_boxes", "replica_part"]


@dataclass(frozen=True)
class Box:
    """One N-d box of a tensor that is also a contiguous run of its flattened elements."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int
    """Where the box starts in the flattened tensor."""

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: Sequence[int], start: int, end: int) -> list[Box]:
    """The boxes covering flattened elements ``[start, end)`` of a tensor of ``shape``, in order.

    See [Note: flat pieces as DCP chunks].
    """
    shape = tuple(int(d) for d in shape)
    if not 0 <= start <= end <= math.prod(shape):
        raise ValueError(f"range [{start}, {end}) is outside a tensor of shape {list(shape)}")
    if start == end:
        return []
    if not shape:
        return [Box((), (), 0)]
    return _boxes(shape, start, end, (), 0)


def _boxes(shape: tuple[int, ...], start: int, end: int, prefix: tuple[int, ...], base: int) -> list[Box]:
    ones = (1,) * len(prefix)
    if len(shape) == 1:
        return [Box(prefix + (start,), ones + (end - start,), base + start)]
    inner = math.prod(shape[1:])
    rest = tuple(0 for _ in shape[1:])
    if inner == 0:
        return []
    first, last = start // inner, (end - 1) // inner
    if first == last and not (start % inner == 0 and end % inner == 0):
        # Inside one row: recurse into it.
        return _boxes(shape[1:], start - first * inner, end - first * inner, prefix + (first,), base + first * inner)
    out: list[Box] = []
    head_end = -(-start // inner) * inner
    if start < head_end:
        out += _boxes(shape[1:], start - first * inner, inner, prefix + (first,), base + first * inner)
    rows0, rows1 = head_end // inner, end // inner
    if rows1 > rows0:
        out.append(Box(prefix + (rows0,) + rest, ones + (rows1 - rows0,) + shape[1:], base + rows0 * inner))
    if end > rows1 * inner:
        out += _boxes(shape[1:], 0, end - rows1 * inner, prefix + (rows1,), base + rows1 * inner)
    return out


def replica_part(start: int, end: int, replica_rank: int, replica_size: int) -> tuple[int, int]:
    """Replica ``replica_rank``'s share of ``[start, end)``; see [Note: replicas split the writing]."""
    n = end - start
    return start + n * replica_rank // replica_size, start + n * (replica_rank + 1) // replica_size


@dataclass(frozen=True)
class Piece:
    """A rank's contiguous part of one stored tensor: elements ``[start, start + numel)`` flattened."""

    shape: tuple[int, ...]
    """The full tensor's shape."""
    start: int
    flat: torch.Tensor
    """The part's elements, 1-D (a view of the rank's storage when saving, a buffer when loading)."""

    def boxes(self) -> list[tuple[ChunkStorageMetadata, torch.Tensor]]:
        """Each box's chunk metadata and the matching view of ``flat``."""
        out = []
        for box in flat_range_boxes(self.shape, self.start, self.start + self.flat.numel()):
            lo = box.flat_start - self.start
            data = self.flat[lo : lo + box.numel].view(box.sizes)
            out.append((ChunkStorageMetadata(offsets=torch.Size(box.offsets), sizes=torch.Size(box.sizes)), data))
        return out


def _chunks_by_key(pieces: dict[str, list[Piece]]) -> dict[str, list[tuple[ChunkStorageMetadata, torch.Tensor]]]:
    return {key: [b for piece in parts for b in piece.boxes()] for key, parts in pieces.items()}


class PieceSavePlanner(DefaultSavePlanner):
    """DCP's default planner for the whole-tensor and bytes entries, plus this rank's boxes of ``pieces``."""

    def __init__(self, pieces: dict[str, list[Piece]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self._shapes = {key: parts[0].shape for key, parts in pieces.items() if parts}
        self._chunks = _chunks_by_key(pieces)
        self._by_offsets = {
            (key, tuple(chunk.offsets)): data for key, chunks in self._chunks.items() for chunk, data in chunks
        }

    def create_local_plan(self) -> SavePlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, chunks in self._chunks.items():
            for chunk, data in chunks:
                items.append(
                    WriteItem(
                        index=MetadataIndex(key, chunk.offsets),
                        type=WriteItemType.SHARD,
                        tensor_data=TensorWriteData(
                            chunk=chunk,
                            properties=TensorProperties.create_from_tensor(data),
                            size=torch.Size(self._shapes[key]),
                        ),
                    )
                )
        self.plan = dataclasses.replace(plan, items=items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        data = self._by_offsets.get((write_item.index.fqn, tuple(write_item.index.offset or ())))
        if data is not None and write_item.type is WriteItemType.SHARD:
            return data
        return super().resolve_data(write_item)


class PieceLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner for the whole-tensor and bytes entries, plus reads into ``pieces``.

    DCP computes the overlap of each requested box with every stored box, so any stored layout
    fills any requested one. A key whose requested elements the stored boxes do not fully cover (a
    checkpoint a tool edited, or one written by an incomplete save) raises ``ValueError`` while
    planning, before anything is read. Bytes entries are read as data (see [Note: checkpoints are
    data]): ``checkpoint`` names the checkpoint in a refusal, ``trusted`` reads them as DCP does.
    """

    def __init__(self, pieces: dict[str, list[Piece]], *, checkpoint: str = "", trusted: bool = False) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)
        self._chunks = _chunks_by_key(pieces)
        self._checkpoint = checkpoint
        self._trusted = is_trusted(trusted)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        info = self.metadata.storage_data.get(read_item.storage_index) if self.metadata else None
        file = getattr(info, "relative_path", "?")
        self.state_dict[read_item.dest_index.fqn] = load_bytes(
            value.getvalue(), checkpoint=self._checkpoint or "(unnamed)", file=file, entry=read_item.dest_index.fqn,
            trusted=self._trusted,
        )

    def create_local_plan(self) -> LoadPlan:
        plan = super().create_local_plan()
        items = list(plan.items)
        for key, chunks in self._chunks.items():
            if not chunks:
                continue
            found = create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], [c for c, _ in chunks])
            wanted = sum(math.prod(c.sizes) for c, _ in chunks)
            covered = sum(math.prod(item.lengths) for item in found)
            if covered != wanted:
                raise ValueError(
                    f"checkpoint entry {key!r} holds {covered} of the {wanted} elements this rank needs; "
                    "the checkpoint is incomplete: load an earlier one (hybridshard.latest_checkpoint)"
                )
            items += found
        return dataclasses.replace(plan, items=items)

    def resolve_tensor(self, read_item: ReadItem):
        key = read_item.dest_index.fqn
        if key in self._chunks:
            data = self._chunks[key][read_item.dest_index.index][1]
            for dim, (offset, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
                data = data.narrow(dim, offset, length)
            return data
        return super().resolve_tensor(read_item)
