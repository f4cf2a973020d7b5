"""Hugging Face ``Trainer`` (on ``accelerate``) training a hybridshard model: :class:`HybridShardTrainer`.

::

    from hybridshard.integrations.hf import HybridShardTrainer

    trainer = HybridShardTrainer(model=model, args=TrainingArguments(...), train_dataset=ds,
                                 strategy="HYBRID_SHARD")
    trainer.train()                       # or train(resume_from_checkpoint=True)
    trainer.save_model("out")             # a directory from_pretrained loads

The subclass shards the model (decoder layers as units, groups from the discovered topology) and
replaces the five places where the ``Trainer`` would otherwise treat the model as a plain replicated
module: preparation (no DDP), gradient accumulation, clipping, checkpoints and ``save_model``.

[Note: no DDP around a sharded model]
On several ranks accelerate's ``prepare_model`` wraps the model in ``DistributedDataParallel``.
DDP checks at construction that every rank holds parameters of the same sizes and then all-reduces
every ``.grad``; a sharded model holds its own slice of each flat buffer (sizes differ, some are
empty) and reduces its gradients itself, so DDP fails at once ("params[0] in this process with sizes
[0] appears not to match"), and if it did not, it would reduce twice. ``prepare_model`` returns a
model marked ``_is_accelerate_prepared`` untouched (its guard against wrapping twice), and the
``Trainer`` sends the model through ``prepare`` only; so the model is marked before the ``Trainer``
sees it. What ``prepare_model`` would have added besides DDP is device placement (``shard`` placed
the model already) and autocast for ``fp16``/``bf16`` arguments, which are refused here in favour
of ``hybridshard.MixedPrecision`` (pass it in ``shard_kwargs``). The ``Trainer``'s own
``model.to(args.device)`` changes nothing: ``args.device`` is where ``shard`` placed the model
(``cpu:0`` is the CPU; see [Note: converting a sharded model] in :mod:`hybridshard.runtime.engine`).
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
from typing import Any

import torch
import torch.distributed as dist

import hybridshard as hs
from hybridshard.integrations.common import require, shard_model

require("accelerate", "hf")
transformers = require("transformers", "hf")
from transformers import Trainer  # noqa: E402 - after the check that names the extra

logger = logging.getLogger(__name__)

__all__ = ["CHECKPOINT_DIR", "HybridShardTrainer", "export_pretrained"]

CHECKPOINT_DIR = "hybridshard"
"""The sub-directory of a Trainer checkpoint (``checkpoint-N/``) that holds ``hs.save_checkpoint``'s output."""

SCHEDULER_NAME = "scheduler.pt"
TRAINING_ARGS_NAME = "training_args.bin"
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json", "model-*.safetensors", "pytorch_model*.bin")


class HybridShardTrainer(Trainer):
    """A ``transformers.Trainer`` whose model is sharded by hybridshard.

    ``strategy``, ``wrap`` and ``groups`` go to :func:`hybridshard.shard` (``wrap=None``: the model's
    ``_no_split_modules`` classes, the decoder layers; ``groups=None``: :func:`hybridshard.init_groups`
    for the hybrid strategies), and ``shard_kwargs`` holds its other arguments (``mixed_precision=``,
    ``param_init_fn=`` ...). A model sharded already is used as it is. Every other argument is the
    ``Trainer``'s. The default process group must exist when the trainer is built: under torchrun,
    ``TrainingArguments`` (through accelerate) creates it when ``args.device`` is first read, which
    happens here before sharding.
    """

    def __init__(
        self,
        model: torch.nn.Module | None = None,
        args: Any = None,
        *trainer_args: Any,
        strategy: hs.ShardingStrategy | str = hs.ShardingStrategy.HYBRID_SHARD,
        wrap: Any = None,
        groups: Any = None,
        shard_kwargs: dict[str, Any] | None = None,
        **trainer_kwargs: Any,
    ) -> None:
        if model is None:
            raise ValueError(
                "HybridShardTrainer needs model=, got None (model_init is not supported: the model is sharded once, "
                "when the trainer is built); build the model and pass it"
            )
        if args is None:
            raise ValueError("HybridShardTrainer needs args= (a TrainingArguments), got None; pass TrainingArguments(...)")
        _check_args(args)
        args.device  # noqa: B018 - accelerate's state initialises the process group under torchrun
        self.sharded = shard_model(model, strategy=strategy, wrap=wrap, groups=groups, shard_kwargs=shard_kwargs or {})
        model._is_accelerate_prepared = True  # See [Note: no DDP around a sharded model]
        super().__init__(model, args, *trainer_args, **trainer_kwargs)

    # Gradient accumulation and clipping

    def training_step(self, model: torch.nn.Module, inputs: Any, num_items_in_batch: Any = None) -> torch.Tensor:
        """[Note: accumulation as no_sync]
        Before each micro-batch the ``Trainer`` sets accelerate's ``sync_gradients``: false for every
        micro-batch of an accumulation window but the last. It then enters ``accelerator.no_sync``,
        which looks for DDP's ``model.no_sync``: it finds the handle's when the model itself was sharded,
        none when a submodule was. So the micro-batches that must not synchronise also run inside
        :func:`hybridshard.no_sync` (which joins an open block), and the last one's backward reduces the
        window's gradients at once, as one backward over all of them would."""
        if self.accelerator.sync_gradients:
            return super().training_step(model, inputs, num_items_in_batch)
        with hs.no_sync(self.sharded):
            return super().training_step(model, inputs, num_items_in_batch)

    def _clip_grad_norm(self, model: torch.nn.Module) -> torch.Tensor:
        # accelerate's clip sees 1-D shards only: the norm of this rank's slice, not the model's.
        return hs.clip_grad_norm_(self.sharded, self.args.max_grad_norm)

    def _get_grad_norm(self, model: torch.nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # max_grad_norm=0: the norm is still logged
            grad_norm = hs.clip_grad_norm_(self.sharded, float("inf"))
        return super()._get_grad_norm(model, grad_norm=grad_norm)

    # Checkpoints and exports

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Write a Hugging Face directory (safetensors, config, generation config) that
        ``from_pretrained`` loads; collective: every rank calls it (the ``Trainer`` does)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        export_pretrained(self.sharded, output_dir)
        if self.args.should_save:
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        """[Note: Trainer checkpoints]
        A Trainer checkpoint ``checkpoint-N/`` holds, besides the ``Trainer``'s own files (state, RNG
        per rank, the exported model), ``hybridshard/``: :func:`hybridshard.save_checkpoint` of the
        model and the optimizer, each rank writing its shard of parameters and optimizer state under
        their full names and shapes, so a resume may use another topology or strategy. The scheduler is
        the same on every rank and rank 0 saves it where the ``Trainer`` looks for it. Resuming loads
        ``hybridshard/`` into model and optimizer once the optimizer exists; a checkpoint saved with
        ``save_only_model=True`` has no ``hybridshard/`` and resumes the weights from the export."""
        hs.save_checkpoint(os.path.join(output_dir, CHECKPOINT_DIR), self.sharded, optimizer=_torch_optimizer(self.optimizer))
        if self.args.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        if os.path.isdir(os.path.join(resume_from_checkpoint, CHECKPOINT_DIR)):
            return  # with the optimizer, in _load_optimizer_and_scheduler; see [Note: Trainer checkpoints]
        hs.load_pretrained(self.sharded, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not os.path.isdir(os.path.join(checkpoint, CHECKPOINT_DIR)):
            return
        hs.load_checkpoint(os.path.join(checkpoint, CHECKPOINT_DIR), self.sharded,
                           optimizer=_torch_optimizer(self.optimizer))
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if os.path.isfile(scheduler):
            self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))


def export_pretrained(model: torch.nn.Module, output_dir: str) -> None:
    """:func:`hybridshard.save_pretrained` into ``output_dir`` without replacing the directory.

    ``save_pretrained`` publishes a whole directory atomically (it replaces ``output_dir``), but a
    ``Trainer``'s ``output_dir`` also holds its ``checkpoint-N/`` directories; so the export goes to a
    sibling first and rank 0 moves its files in, after removing weight files of an earlier save that
    ``from_pretrained`` would otherwise prefer or mix in. Collective."""
    output_dir = os.path.abspath(output_dir)
    staging = output_dir.rstrip(os.sep) + ".hybridshard-export"
    hs.save_pretrained(model, staging, config=getattr(model, "config", None))
    if dist.get_rank() == 0:
        os.makedirs(output_dir, exist_ok=True)
        for pattern in _WEIGHTS:
            for stale in glob.glob(os.path.join(output_dir, pattern)):
                os.remove(stale)
        for name in os.listdir(staging):
            os.replace(os.path.join(staging, name), os.path.join(output_dir, name))
        shutil.rmtree(staging)
        generation = getattr(model, "generation_config", None)
        if generation is not None:
            generation.save_pretrained(output_dir)
        logger.info("exported %s to %s", type(model).__name__, output_dir)
    dist.barrier()  # nobody reads the export before it is complete


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer inside accelerate's ``AcceleratedOptimizer`` (hybridshard checkpoints it by class)."""
    from accelerate.optimizer import AcceleratedOptimizer

    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _check_args(args: Any) -> None:
    """Refuse the ``TrainingArguments`` whose meaning this trainer cannot keep."""
    if getattr(args, "fp16", False) or getattr(args, "bf16", False):
        flag = "fp16" if args.fp16 else "bf16"
        raise ValueError(
            f"HybridShardTrainer computes in the dtype hybridshard gives the model, but TrainingArguments({flag}=True) "
            "asks for autocast; drop it and pass shard_kwargs={'mixed_precision': hybridshard.MixedPrecision("
            "param_dtype=torch.bfloat16)}"
        )
    if getattr(args, "load_best_model_at_end", False):
        raise ValueError(
            "HybridShardTrainer does not support load_best_model_at_end=True (found True); set it to False and "
            "resume from the best checkpoint with train(resume_from_checkpoint=...) or hybridshard.load_checkpoint"
        )
