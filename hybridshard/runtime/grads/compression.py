"""Compressed all-reduce of gradient shards across the replicate group (opt-in).

The replicate group spans nodes, so its all-reduce crosses the slowest links. In the manner of
ZeRO++'s quantized gradients (qgZ), :class:`ReplicateCompressor` sends each value once in bf16 (2
bytes) or int8 (1 byte plus a fp32 scale per ``block_size`` values) instead of fp32 and keeps what
quantization lost for the next call (error feedback), so the error does not pile up over steps.

[Note: compressed replicate all-reduce]
A tensor of ``numel`` elements over ``R`` ranks is cut into ``R`` chunks of
``chunk = ceil(numel / R)`` elements (zero-padded); rank ``i`` owns chunk ``i``.

1. Reduce-scatter as an all-to-all: every rank adds its phase-1 residual to its input, quantizes
   each chunk, keeps ``input - dequantized`` as the new residual and sends chunk ``i`` to rank
   ``i``. The owner dequantizes the ``R`` parts and sums them in fp32 in rank order.
2. All-gather: the owner adds its phase-2 residual to the reduced chunk, quantizes it, keeps the
   new residual and all-gathers the quantized chunk; every rank dequantizes all ``R`` of them.

Every rank dequantizes the same bytes with the same code: the results are bitwise equal across the
group. int8 is symmetric per block of ``block_size`` values of a chunk (the last block may be
shorter): ``q = round(x * 127 / max|x|)``, ``scale = max|x| / 127`` sent as fp32. A block holding a
non-finite value dequantizes to NaN everywhere, so an overflow still shows in the gradient norm;
non-finite residuals are set to 0 so one bad step does not poison the next. Bytes sent and the
error bounds: docs/runtime.md, "Compressed replicate all-reduce".
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Hashable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from hybridshard.runtime.comm import collectives as C

logger = logging.getLogger(__name__)

__all__ = ["MODES", "ReplicateCompressor", "parse_compression"]

MODES = ("bf16", "int8")
"""The compressions :func:`parse_compression` accepts (besides ``None``/``"none"``: no compression)."""

_INT8_MAX = 127.0
_SCALE_BYTES = 4  # fp32: a fp16 scale would flush gradients below ~1e-5 to zero


def parse_compression(value: object) -> str | None:
    """``None`` or ``"none"`` -> ``None`` (exact fp32 all-reduce); ``"bf16"``/``"int8"`` -> itself."""
    if value is None or value == "none":
        return None
    if isinstance(value, str) and value in MODES:
        return value
    raise ValueError(f"compression must be one of None, 'none', {', '.join(repr(m) for m in MODES)}; got {value!r}")


# -- codecs: (rows, chunk) fp32 <-> one packed row per chunk ------------------------------------


def _encode(x: torch.Tensor, mode: str, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize each row of ``x`` (rows, chunk) fp32: ``(packed rows, what they dequantize to)``."""
    if mode == "bf16":
        packed = x.to(torch.bfloat16)
        return packed, packed.float()
    rows, chunk = x.shape
    blocks = -(-chunk // block_size)
    padded = F.pad(x, (0, blocks * block_size - chunk)).view(rows, blocks, block_size)
    amax = padded.abs().amax(dim=2)  # (rows, blocks)
    finite = torch.isfinite(amax)
    scale = torch.where(finite, amax / _INT8_MAX, torch.full_like(amax, float("nan")))
    inverse = torch.where(finite & (amax > 0), _INT8_MAX / amax, torch.zeros_like(amax))
    q = torch.nan_to_num(torch.round(padded * inverse.unsqueeze(2)), nan=0.0).clamp_(-_INT8_MAX, _INT8_MAX)
    packed = torch.empty(rows, _SCALE_BYTES * blocks + chunk, dtype=torch.uint8, device=x.device)
    packed[:, : _SCALE_BYTES * blocks] = scale.view(torch.uint8)
    packed[:, _SCALE_BYTES * blocks :] = q.view(rows, -1)[:, :chunk].to(torch.int8).view(torch.uint8)
    return packed, _decode(packed, mode, block_size, chunk)


def _decode(packed: torch.Tensor, mode: str, block_size: int, chunk: int) -> torch.Tensor:
    """Dequantize packed rows to (rows, chunk) fp32."""
    if mode == "bf16":
        return packed.float()
    rows = packed.shape[0]
    blocks = -(-chunk // block_size)
    # Flattening copies the scale bytes of several rows into one aligned buffer for the fp32 view.
    scale = packed[:, : _SCALE_BYTES * blocks].reshape(-1).view(torch.float32).view(rows, blocks)
    q = packed[:, _SCALE_BYTES * blocks :].view(torch.int8).float()
    values = F.pad(q, (0, blocks * block_size - chunk)).view(rows, blocks, block_size) * scale.unsqueeze(2)
    return values.view(rows, -1)[:, :chunk]


def _residual(x: torch.Tensor, dequantized: torch.Tensor) -> torch.Tensor:
    """What quantization lost, with non-finite entries dropped (see the Note)."""
    lost = x - dequantized
    return torch.where(torch.isfinite(lost), lost, torch.zeros_like(lost))


@dataclass
class _Feedback:
    """One key's residuals: what this rank's sends lost (phase 1) and what its chunk lost (phase 2)."""

    numel: int
    group_size: int
    sent: torch.Tensor
    """(group_size, chunk) fp32."""
    owned: torch.Tensor
    """(1, chunk) fp32."""


class ReplicateCompressor:
    """Approximate sum over a group in bf16 or int8 with error feedback; see [Note: compressed
    replicate all-reduce].

    One thread calls :meth:`all_reduce` per compressor (e.g. the runtime's communication thread);
    :meth:`reset` may come from another thread and waits for a call in progress.
    """

    def __init__(self, mode: str, block_size: int = 256, *, error_feedback: bool = True) -> None:
        parsed = parse_compression(mode)
        if parsed is None:
            raise ValueError(f"ReplicateCompressor needs a compression ({', '.join(MODES)}); got {mode!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive int (values per int8 scale), got {block_size!r}")
        self.mode = parsed
        self.block_size = block_size
        self.error_feedback = error_feedback
        self._feedback: dict[Hashable, _Feedback] = {}
        self._lock = threading.Lock()

    def reset(self) -> None:
        """Drop every key's error-feedback residuals (e.g. after a step that was skipped)."""
        with self._lock:
            self._feedback.clear()

    def all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, *, key: Hashable,
                   stats: C.CollectiveCounts | None = None) -> None:
        """Sum a 1-D fp32 (or bf16) tensor over ``group`` in place, approximately, with per-rank error
        feedback kept under ``key`` (e.g. a unit index). Every rank of the group must call it."""
        if tensor.dim() != 1 or tensor.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(
                f"compressed all-reduce takes a 1-D fp32, bf16 or fp16 tensor; got {tensor.dim()}-D {tensor.dtype}"
            )
        size = C.group_size(group)
        if size == 1:
            return
        with self._lock:
            self._all_reduce(tensor, group, size, key, stats)

    def _state(self, key: Hashable, numel: int, size: int, chunk: int, device: torch.device) -> _Feedback:
        state = self._feedback.get(key)
        if state is None:
            logger.debug("error feedback for key %r: %d elements over %d ranks", key, numel, size)
            zeros = torch.zeros(size + 1, chunk, device=device)
            state = _Feedback(numel, size, sent=zeros[:size], owned=zeros[size:])
            self._feedback[key] = state
        elif (state.numel, state.group_size) != (numel, size):
            raise ValueError(
                f"key {key!r} holds error feedback for {state.numel} elements over {state.group_size} ranks, "
                f"not {numel} over {size}: give each tensor its own key, or call reset() after changing it"
            )
        return state

    def reduce_scatter(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, *, key: Hashable,
                       stats: C.CollectiveCounts | None = None) -> torch.Tensor:
        """Phase 1 alone: this rank's chunk (``ceil(numel / size)`` elements, fp32) of the approximate
        sum of a 1-D tensor over ``group``, with phase-1 error feedback under ``key``. Every rank of
        the group must call it. For the optimizer sharded across replicas (see [Note: optimizer state
        sharded across replicas] in :mod:`hybridshard.runtime.optim.replica_slices`)."""
        size = C.group_size(group)
        if size == 1:
            return tensor.float().clone()
        with self._lock:
            reduced, _, _ = self._phase1(tensor, group, size, key, stats)
        return reduced.view(-1)

    def _phase1(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int, key: Hashable,
                stats: C.CollectiveCounts | None) -> tuple[torch.Tensor, "_Feedback | None", int]:
        """Quantize, all-to-all and sum: ``(this rank's reduced chunk (1, chunk), feedback state, chunk)``."""
        numel, mode, block = tensor.numel(), self.mode, self.block_size
        chunk = -(-numel // size)
        x = torch.zeros(size * chunk, device=tensor.device)
        x[:numel] = tensor
        x = x.view(size, chunk)
        state = self._state(key, numel, size, chunk, tensor.device) if self.error_feedback else None
        if state is not None:
            x += state.sent

        # Phase 1: the owner of chunk i receives every rank's quantized chunk i.
        packed, sent = _encode(x, mode, block)  # (size, P)
        if state is not None:
            state.sent = _residual(x, sent)
        received = torch.empty_like(packed)
        C.all_to_all(received, packed, group, stats=stats)
        parts = _decode(received, mode, block, chunk)  # (size, chunk): row j came from rank j
        reduced = parts[0:1].clone()
        for j in range(1, size):
            reduced += parts[j : j + 1]
        return reduced, state, chunk

    def _all_reduce(self, tensor: torch.Tensor, group: dist.ProcessGroup | None, size: int, key: Hashable,
                    stats: C.CollectiveCounts | None) -> None:
        numel, mode, block = tensor.numel(), self.mode, self.block_size
        reduced, state, chunk = self._phase1(tensor, group, size, key, stats)

        # Phase 2: every rank receives every owner's quantized reduced chunk.
        if state is not None:
            reduced += state.owned
        mine, kept = _encode(reduced, mode, block)  # (1, P)
        if state is not None:
            state.owned = _residual(reduced, kept)
        gathered = torch.empty((size, mine.shape[1]), dtype=mine.dtype, device=mine.device)
        C.all_gather(gathered.view(-1), mine.view(-1), group, stats=stats)
        with torch.no_grad():
            tensor.copy_(_decode(gathered, mode, block, chunk).reshape(-1)[:numel])
