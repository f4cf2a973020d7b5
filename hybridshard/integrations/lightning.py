"""Lightning's ``Trainer`` training a hybridshard model: :class:`HybridShardStrategy`.

::

    import hybridshard.integrations.lightning            # registers strategy="hybridshard"
    trainer = L.Trainer(strategy="hybridshard", accelerator="gpu", devices=8, num_nodes=2,
                        accumulate_grad_batches=4, gradient_clip_val=1.0)
    trainer.fit(module, ckpt_path="last")

or ``strategy=HybridShardStrategy(sharding_strategy="FULL_SHARD", wrap={Block})``. Registered names:
``"hybridshard"`` (HYBRID_SHARD), ``"hybridshard_zero2"``, ``"hybridshard_full_shard"``,
``"hybridshard_shard_grad_op"``, ``"hybridshard_no_shard"``.

In the manner of Lightning's ``FSDPStrategy``, and where it differs:

- setup: the ``LightningModule`` is sharded in place in ``setup`` (decoder layers of Hugging Face
  models as units unless ``wrap=`` says otherwise; groups from the discovered topology), after the
  process group exists and before ``configure_optimizers`` runs, so the optimizer gets the shards
  (``self.parameters()`` there, as with any strategy).
- steps: see [Note: steps through the module's own call].
- gradient accumulation: Lightning enters ``block_backward_sync`` around every micro-batch that
  must not synchronise (DDP's ``no_sync``); here that is :func:`hybridshard.no_sync`.
- clipping: ``gradient_clip_val`` by norm goes through :class:`HybridShardPrecision`, which calls
  :func:`hybridshard.clip_grad_norm_` (the global norm); by value needs no communication.
- checkpoints: see [Note: Lightning checkpoints].
- precision: ``"32-true"`` only; other dtypes through ``shard_kwargs={"mixed_precision": ...}``.
- one optimizer (hybridshard checkpoints one).
"""

from __future__ import annotations

import logging
from collections.abc import Generator
from contextlib import contextmanager, nullcontext
from typing import Any

import torch

import hybridshard as hs
from hybridshard.integrations.common import STRATEGY_NAMES, plain_values, require, shard_model
from hybridshard.integrations.lightning_base import LightningStrategyBase
from hybridshard.state.checkpoint import read_extra

require("lightning", "lightning")
from lightning.pytorch.plugins.precision import Precision  # noqa: E402
from lightning.pytorch.strategies import ParallelStrategy, StrategyRegistry  # noqa: E402

logger = logging.getLogger(__name__)

__all__ = ["HybridShardPrecision", "HybridShardStrategy"]

_CONTEXTS = {"training_step": "train_step_context", "validation_step": "val_step_context",
             "test_step": "test_step_context", "predict_step": "predict_step_context"}
_DROPPED = ("state_dict", "optimizer_states")
"""Keys of Lightning's checkpoint dict that hybridshard's checkpoint stores itself (sharded)."""


class HybridShardPrecision(Precision):
    """32-bit training whose norm clipping is :func:`hybridshard.clip_grad_norm_` over the sharded module."""

    def __init__(self) -> None:
        super().__init__()
        self.sharded: torch.nn.Module | None = None

    def clip_grad_by_norm(self, optimizer: torch.optim.Optimizer, clip_val: float) -> None:
        # torch's clip over the optimizer's 1-D shards would scale by this rank's slice norm only.
        assert self.sharded is not None, "the strategy attaches the sharded module in setup()"
        hs.clip_grad_norm_(self.sharded, clip_val)


class HybridShardStrategy(LightningStrategyBase, ParallelStrategy):
    """Shards the ``LightningModule`` with hybridshard; one process per device, as DDP and FSDP run.

    Keyword arguments: ``sharding_strategy`` (the name ``FSDPStrategy`` uses), ``wrap``, ``groups``,
    ``shard_kwargs`` (for :func:`hybridshard.shard`), ``process_group_backend``, ``timeout``, and
    ``ParallelStrategy``'s (``precision_plugin`` ...); see :class:`LightningStrategyBase`.
    """

    strategy_name = "hybridshard"

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.num_nodes = 1
        self.sharded: torch.nn.Module | None = None

    # Processes and devices: LightningStrategyBase (as DDP and FSDP)

    @property
    def is_distributed(self) -> bool:
        return True  # Lightning then gives each rank its part of the data (DistributedSampler)

    def _configure_launcher(self) -> None:
        from lightning.pytorch.strategies.launchers import _SubprocessScriptLauncher

        if self.launcher_needed():
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)

    # Precision

    @property
    def precision_plugin(self) -> Precision:
        if self._precision_plugin is None:
            self._precision_plugin = HybridShardPrecision()
        return self._precision_plugin

    @precision_plugin.setter
    def precision_plugin(self, plugin: Precision | None) -> None:
        if plugin is not None and type(plugin) is Precision:  # the "32-true" default
            plugin = HybridShardPrecision()
        if plugin is not None and not isinstance(plugin, HybridShardPrecision):
            raise ValueError(
                f"HybridShardStrategy trains in 32-bit (precision='32-true'), but got {type(plugin).__name__} "
                f"(precision={getattr(plugin, 'precision', '?')!r}); drop precision= and pass "
                "HybridShardStrategy(shard_kwargs={'mixed_precision': hybridshard.MixedPrecision(param_dtype=torch.bfloat16)})"
            )
        self._precision_plugin = plugin

    # Model and optimizer

    def model_to_device(self) -> None:
        pass  # shard() places each shard on the device of its groups

    def setup(self, trainer: Any) -> None:
        assert self.accelerator is not None and self.model is not None
        self.accelerator.setup(trainer)
        if self.sharded is None:
            device = self.shard_kwargs.pop("device", self.root_device)
            self.sharded = shard_model(self.model, strategy=self.sharding_strategy, wrap=self.wrap,
                                       groups=self.groups, shard_kwargs={"device": device, **self.shard_kwargs})
        self.precision_plugin.sharded = self.sharded
        self.barrier()
        if trainer.state.fn == "fit":
            self.setup_optimizers(trainer)
            if len(self.optimizers) != 1:
                raise ValueError(
                    f"HybridShardStrategy trains with one optimizer, but configure_optimizers returned "
                    f"{len(self.optimizers)}; return one (with parameter groups if the parameters need different settings)"
                )
        self.setup_precision_plugin()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("training_step", *args, **kwargs)

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("validation_step", *args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("test_step", *args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._step("predict_step", *args, **kwargs)

    def _step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """[Note: steps through the module's own call]
        ``shard`` puts the root unit's hooks (gather before, free after) on the module's ``__call__``,
        but Lightning calls ``training_step`` and the other steps directly, so the parameters of the
        root unit (those outside every wrapped layer: embeddings, head, final norm) would stay 1-D
        shards. Strategies that wrap the module redirect each step through the wrapper's forward
        (Lightning's ``_ForwardRedirection``); the sharded module is its own wrapper here, so the step
        is redirected through the sharded module's own call, and its hooks run around it."""
        assert self.lightning_module is not None and self.sharded is not None
        with getattr(self.precision_plugin, _CONTEXTS[name])():
            if self.sharded is self.lightning_module:
                return self._forward_redirection(self.sharded, self.lightning_module, name, *args, **kwargs)
            return getattr(self.lightning_module, name)(*args, **kwargs)  # a submodule was sharded: its call gathers

    @contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's gradient accumulation: no gradient communication on this micro-batch."""
        with hs.no_sync(self.sharded) if self.sharded is not None else nullcontext():
            yield

    def teardown(self) -> None:
        # The shards stay where shard() put them: moving a sharded module raises (Strategy.teardown moves it to the CPU).
        self.precision_plugin.teardown()
        if self.accelerator is not None:
            self.accelerator.teardown()
        self.checkpoint_io.teardown()

    # Checkpoints

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # model sharded and optimizer built before the load

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # load_checkpoint loads it

    def lightning_module_state_dict(self) -> dict[str, Any]:
        return {}  # in the sharded checkpoint; see [Note: Lightning checkpoints]

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        pass

    def load_optimizer_state_dict(self, checkpoint: Any) -> None:
        pass

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """[Note: Lightning checkpoints]
        A checkpoint is a directory (at the path Lightning chose, ``….ckpt`` included) written by
        :func:`hybridshard.save_checkpoint`: every rank writes its shard of the parameters and of the
        optimizer state under full names and shapes, and Lightning's own entries (loops, epoch and
        step, callbacks, schedulers, hyperparameters) go in as its ``extra``. So every rank calls it
        (Lightning's ``Trainer.save_checkpoint`` does), unlike DDP's rank-0 file, and it loads on
        another topology or strategy. ``load_checkpoint`` runs after setup, reads model and optimizer
        in place, and hands Lightning the rest back. ``ModelCheckpoint`` and ``ckpt_path=`` work as
        with any strategy; rank 0 removes old checkpoints (``remove_checkpoint``) as usual. Lightning's
        entries are made plain first (:func:`~hybridshard.integrations.common.plain_values`: its
        ``AttributeDict`` hyperparameters, paths, numpy scalars ...), so the resume reads them as data."""
        if storage_options is not None:
            raise ValueError(
                f"HybridShardStrategy.save_checkpoint writes a directory and takes no storage_options (got "
                f"{storage_options!r}); call trainer.save_checkpoint(path) without them"
            )
        extra, converted = plain_values({k: v for k, v in checkpoint.items() if k not in _DROPPED}, "checkpoint")
        if converted:
            logger.info("checkpoint state made plain for %s: %s", filepath, ", ".join(converted))
        result = hs.save_checkpoint(str(filepath), self.sharded,
                                    optimizer=self.optimizers[0] if self.optimizers else None, extra=extra)
        logger.info("saved %s: %d bytes on this rank in %.2f s", result.path, result.bytes_per_rank[self.global_rank],
                    result.seconds)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None) -> dict[str, Any]:
        extra = read_extra(str(checkpoint_path))  # checked before anything changes
        if not isinstance(extra, dict):
            raise ValueError(
                f"{checkpoint_path} is a hybridshard checkpoint without Lightning's state (extra={type(extra).__name__}); "
                "resume from a checkpoint HybridShardStrategy wrote, or load this one with hybridshard.load_checkpoint"
            )
        optimizer = self.optimizers[0] if self.optimizers else None
        extra = hs.load_checkpoint(str(checkpoint_path), self.sharded, optimizer=optimizer)
        return {**extra, "state_dict": {}, "optimizer_states": []}

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        for name, strategy in STRATEGY_NAMES.items():
            strategy_registry.register(name, cls, description=f"hybridshard {strategy}", sharding_strategy=strategy,
                                       override=True)


HybridShardStrategy.register_strategies(StrategyRegistry)  # Lightning registers only its own strategies itself
