"""Storage of one unit's flat parameter: the sharded master, the unsharded buffer, views, gradient shards.

Knows tensors and the :class:`~hybridshard.runtime.units.layout.FlatLayout`; knows nothing about hooks, states or
process groups (the unit drives it, :mod:`hybridshard.runtime.comm.collectives` moves bytes).

See [Note: two kinds of views] in docs/runtime.md. Collectives write through ``unsharded.data``, whose
version counter is not shared with the leaf, so refilling the storage does not trip autograd's
saved-tensor check.

[Note: who holds the gradient shard]
A unit's reduced gradient is one flat tensor of this rank's shard size; each trainable parameter's
``.grad`` is a view of its part of it. Only those views hold it: the flat parameter keeps a weak
reference, so ``optimizer.zero_grad(set_to_none=True)`` (every ``.grad`` set to ``None``) frees
the whole shard. The next reduction finds it again through the weak reference while any ``.grad``
still views it and adds into it in place; a ``.grad`` the user replaced is copied in and one set to
``None`` counts as zero, exactly as if the flat tensor had been held all along.
"""

from __future__ import annotations

import logging
import weakref
from typing import Sequence

import torch
import torch.nn as nn

from hybridshard.runtime.trace import host_syncs
from hybridshard.runtime.units.layout import FlatLayout
from hybridshard.runtime.units.offload import CPUOffload, Staged, place_master, stage

logger = logging.getLogger(__name__)

__all__ = ["FlatParam"]


class FlatParam:
    """One unit's parameters as a sharded master plus a gatherable flat buffer."""

    def __init__(
        self,
        layout: FlatLayout,
        params: Sequence[nn.Parameter],
        sharded: torch.Tensor,
        *,
        compute_dtype: torch.dtype,
        grad_dtype: torch.dtype,
        offload: CPUOffload | None = None,
        device: torch.device | None = None,
        owned: tuple[int, int] | None = None,
    ) -> None:
        """``sharded`` is this rank's master shard (``layout.shard_numel`` elements); it is kept, not copied
        (moved to CPU memory when offloading). ``device`` is the compute device (default: the shard's).
        ``owned`` is the ``[start, end)`` of the shard that the original parameters view and the
        optimizer steps: the whole shard by default, this replica's slice of it when the optimizer is
        sharded across replicas (see [Note: optimizer state sharded across replicas] in
        :mod:`hybridshard.runtime.optim.replica_slices`)."""
        assert len(params) == len(layout.slots) and sharded.numel() == layout.shard_numel
        self.layout = layout
        self.params = tuple(params)
        lo, hi = owned if owned is not None else (0, layout.shard_numel)
        assert 0 <= lo <= hi <= layout.shard_numel
        self.owned_range = (lo, hi)
        self.owned_numel = hi - lo
        """Elements of the shard the parameters view: the length of gradient shards and optimizer state."""
        shard_start = layout.shard_range()[0]
        self.local = layout.slices_in(shard_start + lo, shard_start + hi)
        """Per slot, its part of the owned range (``shard_offset`` counted from the range's start)."""
        self._expected: tuple[int, list[tuple[int, int]]] | None = None
        """The master's address, and per slot the address and length of the view ``use_sharded_params``
        makes: what ``writeback_params`` expects to find."""
        self._grad_split = _split_sizes([(part.shard_offset, part.numel) for part in self.local], self.owned_numel)
        """Pieces of an owned-sized gradient, one per slot with elements: see ``accumulate_grad_shard``."""
        self._split_sizes: tuple[list[int], list[int | None]] | None = None
        """The split that makes the trainable views, computed at the first gather; see [Note: one split, one gradient buffer]."""
        self.device = sharded.device if device is None else device
        """The compute device: where the unsharded buffer lives (the master may be offloaded)."""
        self.sharded = sharded if offload is None else place_master(sharded, offload)
        self.offload = offload
        self._staged: Staged | None = None
        """The next all-gather's input, made ahead (offload only; see [Note: CPU offload])."""
        self._arriving: list[torch.Tensor] = []
        """Offloaded: reduced gradient shards copied to host memory, not yet added to ``.grad``."""
        self.owned = self.sharded if owned is None else self.sharded[lo:hi]
        """The owned range of the master shard: what the optimizer steps (a view of ``sharded``, or
        the separate master slice)."""
        self.separate_master = owned is not None and compute_dtype != sharded.dtype and sharded.is_floating_point()
        """The master slice is its own tensor and ``sharded`` holds the compute dtype; see [Note:
        optimizer state sharded across replicas] in :mod:`hybridshard.runtime.optim.replica_slices`."""
        if self.separate_master:
            self.owned = self.owned.clone()
            self.sharded = self.sharded.to(compute_dtype)
        self.compute_dtype = compute_dtype
        self.grad_dtype = grad_dtype
        # The leaf requires grad even when every parameter is frozen now: a parameter unfrozen after
        # shard() must still get gradients (frozen views are cut from the graph in unsharded_views).
        self.requires_grad = self.sharded.is_floating_point()
        # A single-rank shard group computing in the master dtype needs no second copy: the
        # "unsharded" buffer is the master itself and is never freed.
        self.aliases_master = (layout.shard_size == 1 and compute_dtype == self.sharded.dtype
                               and self.sharded.device == self.device)
        # Until the first gather the leaf is empty: no unit's unsharded buffer is allocated during
        # shard(), so building a unit costs its shard and nothing more (see alloc_storage).
        self.unsharded = torch.empty(0, dtype=compute_dtype, device=self.device)
        if self.aliases_master:
            self.unsharded.data = self.sharded
        self.unsharded.requires_grad_(self.requires_grad)
        self._grad_ref: weakref.ref | None = None
        """The flat gradient shard the parameters' ``.grad`` view; see [Note: who holds the gradient shard]."""
        for p in self.params:
            # keep_low_precision_grads: a bf16 .grad next to an fp32 parameter (checked in shard()).
            if grad_dtype != self.owned.dtype:  # frozen ones too: they may be unfrozen later
                p.grad_dtype = grad_dtype
        self.use_sharded_params()

    # -- the sharded side ------------------------------------------------------------------------

    def shard_view(self, i: int, flat: torch.Tensor | None = None) -> torch.Tensor:
        """Slot ``i``'s part of an owned-sized tensor (the master's owned range by default), flattened."""
        part = self.local[i]
        flat = self.owned if flat is None else flat
        return flat[part.shard_offset : part.shard_offset + part.numel]

    def use_sharded_params(self) -> None:
        """Point every original parameter's ``.data`` at its part of the master shard."""
        for i, p in enumerate(self.params):
            p.data = self.shard_view(i)

    def master_versions(self) -> tuple[int, ...]:
        """Version counters of the master and of each original parameter, in slot order.

        An in-place change of the master bumps the master's counter when made on it directly and the
        parameter's when made through an original parameter (``.data`` assignment gives a parameter
        a counter of its own).
        """
        master = self.sharded._version + (self.owned._version if self.separate_master else 0)
        return (master, *(p._version for p in self.params))

    def writeback_params(self) -> None:
        """Copy into the master any parameter whose ``.data`` the user replaced since the last step.

        A replacement of the wrong size cannot be placed and raises, naming the parameter. Called at
        every gather, so a parameter still pointing at its part of the master is recognised from its
        address and shape alone, without making a view of the master for it.
        """
        base = self.owned.data_ptr()
        if self._expected is None or self._expected[0] != base:
            itemsize = self.owned.element_size()
            self._expected = (base, [(base + part.shard_offset * itemsize, part.numel) for part in self.local])
        for i, (p, (address, numel)) in enumerate(zip(self.params, self._expected[1])):
            if p.data_ptr() == address and p.dim() == 1 and p.shape[0] == numel:
                continue  # the view use_sharded_params made (or one just like it)
            view = self.shard_view(i)
            if p.numel() != view.numel():
                raise ValueError(
                    f"parameter {self.layout.slots[i].name!r} was replaced by a tensor of {p.numel()} elements; "
                    f"this rank holds {view.numel()} of its elements. Update sharded parameters in place "
                    "(optimizer steps, copy_) or load a full state dict with hybridshard.load_full_state_dict"
                )
            logger.debug("writing back replaced parameter %s", self.layout.slots[i].name)
            view.copy_(p.data.reshape(-1))
            if self.separate_master:  # and this replica's compute copy of it
                part = self.local[i]
                lo = self.owned_range[0] + part.shard_offset
                self.sharded[lo : lo + part.numel].copy_(view)
            p.data = view

    # -- the unsharded side ----------------------------------------------------------------------

    def alloc_storage(self) -> None:
        if self.unsharded.numel() != self.layout.padded_numel:
            # First gather: give the leaf its shape. Its storage object stays the same from here on
            # (freed and regrown in place), which the views autograd saves rely on.
            self.unsharded.data = torch.empty(self.layout.padded_numel, dtype=self.compute_dtype,
                                              device=self.device)
            return
        storage = self.unsharded.untyped_storage()
        nbytes = self.layout.padded_numel * self.unsharded.element_size()
        if storage.size() != nbytes:
            storage.resize_(nbytes)

    def _free_storage(self) -> None:
        self.unsharded.untyped_storage().resize_(0)

    def free_storage(self) -> None:
        if not self.aliases_master:
            self._free_storage()

    def gather_input(self) -> torch.Tensor:
        """This rank's contribution to the all-gather: the master shard in the compute dtype, on the
        compute device (an offloaded master is copied there, ahead when staged; see [Note: CPU offload])."""
        staged, self._staged = self._staged, None
        if staged is not None:
            tensor = staged.take(self.master_versions(), self.device)
            if tensor is not None:
                return tensor
        return self._make_gather_input()

    def stage_gather_input(self, stream: object) -> bool:
        """Make the next all-gather's input now, on ``stream`` (the copy stream; ``None``: here), when
        the master is offloaded; whether it was staged."""
        if self.offload is None or self.aliases_master or self._staged is not None or not self.layout.slots:
            return False
        self._staged = stage(self._make_gather_input, self.master_versions(), stream)
        return True

    def drop_staged(self) -> None:
        self._staged = None

    def _make_gather_input(self) -> torch.Tensor:
        if self.sharded.device != self.device:
            return self.sharded.to(self.device, dtype=self.compute_dtype, non_blocking=True)
        return self.sharded if self.sharded.dtype == self.compute_dtype else self.sharded.to(self.compute_dtype)

    def unsharded_views(self) -> list[torch.Tensor]:
        """One view of the unsharded buffer per slot; see [Note: two kinds of views].

        [Note: one split, one gradient buffer]
        The trainable views come from one ``split`` of the leaf (the padding between and after
        slots are pieces of their own), so autograd builds the flat gradient with one ``cat`` in
        backward. A slice per parameter would make each slice's backward a zero-filled buffer of
        the whole unit, summed into the flat gradient: several unit-sized buffers alive at once
        (about 14 MB at the bench's peak). Every element of the gradient comes from exactly one
        view either way, so the values are the same.
        """
        if self._split_sizes is None:
            self._split_sizes = _split_sizes([(slot.offset, slot.numel) for slot in self.layout.slots],
                                             self.layout.padded_numel)
        sizes, piece_of_slot = self._split_sizes
        if sum(sizes) != self.unsharded.numel() or not any(p.requires_grad for p in self.params):
            piece_of_slot = [None] * len(self.params)  # slice per parameter, as before
        pieces = self.unsharded.split(sizes) if any(i is not None for i in piece_of_slot) else None
        views = []
        detached = None
        for slot, p, piece in zip(self.layout.slots, self.params, piece_of_slot):
            if p.requires_grad and piece is not None:
                views.append(pieces[piece].view(slot.shape))
                continue
            if p.requires_grad:  # a slot the split could not give its own piece (overlapping slots)
                base = self.unsharded
            else:  # frozen: no gradient flows to the flat buffer from this view
                detached = self.unsharded.detach() if detached is None else detached
                base = detached
            views.append(base[slot.offset : slot.end].view(slot.shape))
        return views

    def local_chunk(self) -> torch.Tensor:
        """This rank's chunk of the unsharded buffer (same elements as the master shard)."""
        start, end = self.layout.shard_range()
        return self.unsharded.detach()[start:end]

    # -- gradient shards -------------------------------------------------------------------------

    @property
    def sharded_grad(self) -> torch.Tensor | None:
        """The flat gradient shard that some trainable parameter's ``.grad`` views, else ``None``."""
        flat = self._grad_ref() if self._grad_ref is not None else None
        if flat is None:
            return None
        viewed = any(p.grad is not None and p.grad._base is flat for p in self.params if p.requires_grad)
        return flat if viewed else None

    def accumulate_grad_shard(self, grad_shard: torch.Tensor) -> None:
        """Add a reduced gradient shard to each parameter's ``.grad`` (a view of one flat shard).

        Offloaded, the shard is only sent on its way to host memory here; :meth:`land_grad_shard`
        adds it once :func:`~hybridshard.runtime.units.offload.arrived` ran (see [Note: CPU offload])."""
        if self.offload is not None:  # into new host memory (pinned on CUDA), not blocking
            pin = self.offload.pin_memory and grad_shard.is_cuda
            host = host_syncs.mark_host(torch.empty(grad_shard.shape, dtype=self.grad_dtype, pin_memory=pin))
            host.copy_(grad_shard, non_blocking=True)
            self._arriving.append(host)
            return
        self._add_grad_shard(grad_shard.to(dtype=self.grad_dtype))

    @property
    def grad_arriving(self) -> bool:
        """Offloaded gradient shards were sent to host memory and not added yet."""
        return bool(self._arriving)

    def land_grad_shard(self) -> None:
        """Add the offloaded gradient shards sent since the last call (their copies have arrived)."""
        arriving, self._arriving = self._arriving, []
        for grad_shard in arriving:
            self._add_grad_shard(grad_shard)

    def drop_arriving(self) -> None:
        """After a backward that raised: forget the gradient shards still on their way."""
        self._arriving = []

    def _add_grad_shard(self, grad_shard: torch.Tensor) -> None:
        current = self._existing_grad_shard()
        if current is not None:
            grad_shard = current.add_(grad_shard)
        elif grad_shard._base is not None:
            # A slice of the unsharded gradient (a shard group of one): the parameters' views will
            # refer to its base, so that is the tensor to find again (see the note above).
            base = grad_shard._base
            whole = base.dim() == 1 and base.numel() == grad_shard.numel() and grad_shard.storage_offset() == 0
            grad_shard = base if whole else grad_shard.clone()
        self._grad_ref = weakref.ref(grad_shard)
        sizes, piece_of_slot = self._grad_split  # one split for every slot, not one slice each
        pieces = grad_shard.split(sizes)
        for i, (p, piece) in enumerate(zip(self.params, piece_of_slot)):
            if p.requires_grad:
                p.grad = self.shard_view(i, grad_shard) if piece is None else pieces[piece]

    def _existing_grad_shard(self) -> torch.Tensor | None:
        """The flat gradient shard the parameters' ``.grad`` currently show, or ``None`` if all are unset.

        Gradients the user replaced are copied in; gradients set to ``None`` count as zero.
        """
        trainable = [(i, p) for i, p in enumerate(self.params) if p.requires_grad]
        if all(p.grad is None for _, p in trainable):
            return None
        flat = self._grad_ref() if self._grad_ref is not None else None
        if flat is None:
            flat = torch.zeros(self.owned_numel, dtype=self.grad_dtype, device=self.sharded.device)
        for i, p in trainable:
            view = self.shard_view(i, flat)
            if p.grad is None:
                view.zero_()
            elif p.grad.data_ptr() != view.data_ptr() or p.grad.shape != view.shape:
                view.copy_(p.grad.reshape(-1))
        return flat


def _split_sizes(parts: Sequence[tuple[int, int]], total: int) -> tuple[list[int], list[int | None]]:
    """Piece sizes that cover ``total`` elements (the ``(offset, numel)`` parts and the gaps between
    them) and, per part, the index of its piece (``None`` for a part that starts before the end of the
    one before: an overlap, or an empty part of a shard placed at 0); see [Note: one split, one
    gradient buffer]."""
    sizes: list[int] = []
    piece_of_part: list[int | None] = []
    cursor = 0
    for offset, numel in parts:
        if offset < cursor:
            piece_of_part.append(None)
            continue
        if offset > cursor:
            sizes.append(offset - cursor)
        piece_of_part.append(len(sizes))
        sizes.append(numel)
        cursor = offset + numel
    if total > cursor:
        sizes.append(total - cursor)
    return sizes, piece_of_part
