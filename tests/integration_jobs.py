"""Rank-side jobs of tests/test_integrations.py: the tiny Llama of tests/hf_models.py trained by the
Hugging Face ``Trainer`` (:class:`hybridshard.integrations.hf.HybridShardTrainer`) and by Lightning's
``Trainer`` (:class:`hybridshard.integrations.lightning.HybridShardStrategy`), and the one-process
reference both are compared with.

Data: ``ROWS`` fixed sequences (tests/hf_models.py's rule), read in order. A trainer on ``world``
ranks gives rank ``r`` micro-batch ``i`` the rows of global micro-batch ``i`` at ``r * MICRO``; so
step ``s`` of every run trains on rows ``[s * W, (s + 1) * W)`` with ``W = ACCUM * world * MICRO``,
which is what the reference takes in one process.
"""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch

from tests import hf_models as HF

MICRO, ACCUM, STEPS, LR, CLIP = 2, 2, 4, 0.1, 0.5
"""Per-rank micro-batch, micro-batches per step, steps, SGD learning rate, max gradient norm."""
ADAMW_LR, WARMUP = 2e-3, 1
"""The AdamW runs: peak learning rate, and warm-up steps of the linear schedule (then down to 0)."""
LIT_STEPS = 2
"""Steps per epoch of the Lightning runs (which resume from an epoch's end): the rows of steps 0 and 1."""


def rows(world: int) -> dict[str, torch.Tensor]:
    """Every sequence the runs train on, in order."""
    return HF.batch(0, 0, STEPS * ACCUM * world * MICRO)


class Rows(torch.utils.data.Dataset):
    """``rows`` as a map-style dataset of dicts (what the Trainer's default collator stacks)."""

    def __init__(self, world: int) -> None:
        self.data = rows(world)

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def reference(world: int, blocks: list[int], *, clip: float | None = CLIP, optim: str = "sgd") -> dict[str, Any]:
    """One plain process: for each step, the rows of step ``blocks[i]`` in ``ACCUM`` micro-batches,
    token-mean loss, SGD clipped at ``clip`` (None: not clipped), or with ``optim="adamw"`` AdamW on
    the linear schedule with warm-up (:func:`linear_lr`). ``norms``: each step's total gradient norm."""
    model, _ = HF.make_model("llama")
    if optim == "adamw":
        opt, schedule = adamw_with_schedule(model.parameters(), len(blocks))
    else:
        opt, schedule = torch.optim.SGD(model.parameters(), lr=LR), None
    data, width = rows(world), ACCUM * world * MICRO
    losses, norms, learning_rates = [], [], []
    for step in blocks:
        learning_rates.append(opt.param_groups[0]["lr"])
        total = 0.0
        for m in range(ACCUM):
            lo = step * width + m * world * MICRO
            loss = model(**{k: v[lo : lo + world * MICRO] for k, v in data.items()}).loss / ACCUM
            loss.backward()
            total += loss.item()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip is not None else float("inf"))))
        opt.step()
        if schedule is not None:
            schedule.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return {"losses": losses, "norms": norms, "learning_rates": learning_rates,
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def linear_lr(step: int, steps: int) -> float:
    """The factor of step ``step`` (0-based) on a linear schedule: up over ``WARMUP`` steps, then down
    to 0 at ``steps`` (written here from its definition, not taken from transformers)."""
    if step < WARMUP:
        return step / WARMUP
    return max(0.0, (steps - step) / (steps - WARMUP))


def logits_of(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**HF.batch(7, 0, 2)).logits


# Hugging Face Trainer


def _hf_args(out: str, steps: int, save_steps: int | None, optim: str) -> Any:
    from transformers import TrainingArguments

    if optim == "adamw":  # unclipped (the norm is still logged), on a schedule that changes every step
        rule = dict(learning_rate=ADAMW_LR, optim="adamw_torch", lr_scheduler_type="linear", warmup_steps=WARMUP,
                    max_grad_norm=0.0)
    else:
        rule = dict(learning_rate=LR, optim="sgd", lr_scheduler_type="constant", max_grad_norm=CLIP)
    return TrainingArguments(
        output_dir=out, max_steps=steps, per_device_train_batch_size=MICRO, gradient_accumulation_steps=ACCUM,
        weight_decay=0.0, train_sampling_strategy="sequential", logging_steps=1, report_to=[], disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, use_cpu=True,
        dataloader_num_workers=0, seed=0, **rule,
    )


def _hf_losses(trainer: Any, key: str = "loss") -> list[float]:
    return [h[key] for h in trainer.state.log_history if key in h]


def hf_train(strategy: str, out: str, optim: str = "sgd") -> dict[str, Any]:
    """Train ``STEPS`` steps saving a checkpoint at step 2, export with ``save_model``; then resume a fresh
    trainer from that checkpoint (the second half's losses, final state). ``optim``: "sgd" (clipped,
    constant rate; also resumed from a checkpoint holding only the export) or "adamw" (unclipped, linear
    schedule with warm-up: the resume must restore both moments and the schedule's step)."""
    import hybridshard as hs
    from hybridshard.integrations.hf import CHECKPOINT_DIR, HybridShardTrainer
    from tests import runtime_models as RM

    world = torch.distributed.get_world_size()
    model, _ = HF.make_model("llama")
    trainer = HybridShardTrainer(model=model, args=_hf_args(out, STEPS, save_steps=2, optim=optim),
                                 train_dataset=Rows(world), strategy=strategy, groups=RM.groups())
    trainer.train()
    result: dict[str, Any] = {
        "losses": _hf_losses(trainer), "state": hs.full_state_dict(model), "logits": logits_of(model),
        "grad_norms": _hf_losses(trainer, "grad_norm"), "learning_rates": _hf_losses(trainer, "learning_rate"),
        "ddp": type(trainer.model_wrapped).__name__, "units": len(model.hybridshard_runtime.units),
    }
    trainer.save_model(out)
    result["checkpoints"] = sorted(d for d in os.listdir(out) if d.startswith("checkpoint-"))

    model, _ = HF.make_model("llama", seed=1)  # other weights: the resume must replace them
    resumed = HybridShardTrainer(model=model, args=_hf_args(out, STEPS, save_steps=None, optim=optim),
                                 train_dataset=Rows(world), strategy=strategy, groups=RM.groups())
    resumed.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2"))
    result["resumed_losses"] = _hf_losses(resumed)
    result["resumed_grad_norms"] = _hf_losses(resumed, "grad_norm")
    result["resumed_learning_rates"] = _hf_losses(resumed, "learning_rate")
    result["resumed_state"] = hs.full_state_dict(model)
    if optim != "sgd":
        return result

    # A checkpoint without hybridshard/ (as save_only_model=True writes it): the weights come from the export.
    # Plain SGD keeps no optimizer state, so the run must still continue exactly.
    only = os.path.join(out, "model-only-2")
    if torch.distributed.get_rank() == 0:
        shutil.copytree(os.path.join(out, "checkpoint-2"), only, ignore=shutil.ignore_patterns(CHECKPOINT_DIR))
    torch.distributed.barrier()
    model, _ = HF.make_model("llama", seed=1)
    HybridShardTrainer(model=model, args=_hf_args(out, STEPS, save_steps=None, optim=optim), train_dataset=Rows(world),
                       strategy=strategy, groups=RM.groups()).train(resume_from_checkpoint=only)
    result["model_only_state"] = hs.full_state_dict(model)
    return result


def hf_errors(out: str) -> dict[str, str]:
    """First lines of the errors for arguments the trainer refuses."""
    from transformers import TrainingArguments

    from hybridshard.integrations.hf import HybridShardTrainer

    def first_line(**kw: Any) -> str:
        try:
            HybridShardTrainer(**kw)
        except ValueError as e:
            return str(e).splitlines()[0]
        return "returned"

    model, _ = HF.make_model("llama")
    args = dict(output_dir=out, use_cpu=True, report_to=[])
    return {
        "no_model": first_line(args=TrainingArguments(**args)),
        "no_args": first_line(model=model),
        "bf16": first_line(model=model, args=TrainingArguments(**args, bf16=True)),
        "best": first_line(model=model, args=TrainingArguments(**args, load_best_model_at_end=True,
                                                               eval_strategy="steps", save_strategy="steps")),
    }


# Lightning


def _lightning_env() -> None:
    """What torchrun sets besides the pool's variables, so Lightning finds a torchelastic launch."""
    os.environ.setdefault("TORCHELASTIC_RUN_ID", "hybridshard-tests")
    os.environ.setdefault("GROUP_RANK", str(int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"])))
    os.environ.setdefault("MASTER_PORT", "29500")


def adamw_with_schedule(params: Any, steps: int) -> tuple[torch.optim.Optimizer, Any]:
    """AdamW (both moments kept) on the linear schedule with warm-up of :func:`linear_lr` over ``steps``."""
    opt = torch.optim.AdamW(params, lr=ADAMW_LR, weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: linear_lr(step, steps))


def _lit_module(seed: int, optim: str = "sgd", steps: int = STEPS) -> Any:
    import lightning as L

    class LitLlama(L.LightningModule):
        """The tiny Llama as a LightningModule: the loss and learning rate of each micro-batch are kept to compare."""

        def __init__(self) -> None:
            super().__init__()
            self.llama, _ = HF.make_model("llama", seed=seed)
            self.losses: list[float] = []
            self.learning_rates: list[float] = []

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.llama(**batch).loss
            self.losses.append(loss.item())
            self.learning_rates.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return loss

        def configure_optimizers(self) -> Any:
            if optim == "adamw":  # the schedule steps with the optimizer, once per accumulated step
                opt, schedule = adamw_with_schedule(self.parameters(), steps)
                return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}
            return torch.optim.SGD(self.parameters(), lr=LR)

    return LitLlama()


def _step_losses(micro_losses: list[float]) -> list[float]:
    """Each step's loss: the mean over ranks and over its ``ACCUM`` micro-batches."""
    t = torch.tensor(micro_losses, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return (t / torch.distributed.get_world_size()).reshape(-1, ACCUM).mean(dim=1).tolist()


def lightning_train(strategy: str, out: str, epochs: int = 2, clip: float | None = CLIP, optim: str = "sgd") -> dict[str, Any]:
    """``Trainer.fit`` for ``epochs`` epochs of ``LIT_STEPS`` steps each, a checkpoint per epoch; then a fresh
    module (other weights) resumed from the first epoch's checkpoint. ``strategy``: a registered name
    (``"hybridshard"``), or ``"instance:<sharding strategy>"`` for a ``HybridShardStrategy`` object.
    ``clip``: ``gradient_clip_val`` (None: unclipped SGD, where a gradient off by a constant factor shows).
    ``optim``: "sgd" at a constant rate, or "adamw" on the linear schedule with warm-up over all the steps
    (the resume must restore both moments and the schedule's step)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hybridshard as hs
    import hybridshard.integrations.lightning  # noqa: F401 - registers strategy="hybridshard"
    from hybridshard.integrations.lightning import HybridShardStrategy
    from tests import runtime_models as RM

    _lightning_env()
    world = torch.distributed.get_world_size()
    # Lightning's own sampler shuffles training data (seeded); this one reads in order, as the reference.
    rows_used = torch.utils.data.Subset(Rows(world), range(LIT_STEPS * ACCUM * world * MICRO))
    sampler = torch.utils.data.DistributedSampler(rows_used, shuffle=False)
    data = torch.utils.data.DataLoader(rows_used, batch_size=MICRO, sampler=sampler)

    def fit(module: Any, ckpt_path: str | None, **overrides: Any) -> Any:
        chosen: Any = strategy
        if strategy.startswith("instance:"):
            chosen = HybridShardStrategy(sharding_strategy=strategy.split(":")[1], groups=RM.groups())
        settings = {"accumulate_grad_batches": ACCUM, "gradient_clip_val": clip, **overrides}
        trainer = L.Trainer(
            strategy=chosen, accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]),
            num_nodes=world // int(os.environ["LOCAL_WORLD_SIZE"]), max_epochs=epochs, logger=False,
            enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False,
            callbacks=[ModelCheckpoint(dirpath=out, save_top_k=-1)], **settings,
        )
        trainer.fit(module, data, ckpt_path=ckpt_path)
        return trainer

    module = _lit_module(seed=0, optim=optim, steps=epochs * LIT_STEPS)
    trainer = fit(module, None)
    result: dict[str, Any] = {
        "losses": _step_losses(module.losses), "learning_rates": module.learning_rates[::ACCUM],
        "strategy": type(trainer.strategy).__name__,
        "units": len(module.hybridshard_runtime.units), "global_step": trainer.global_step,
        "state": {k.removeprefix("llama."): v for k, v in hs.full_state_dict(module).items()},
        "checkpoints": sorted(os.listdir(out)),
    }
    first = os.path.join(out, next(c for c in result["checkpoints"] if c.startswith("epoch=0")))
    resumed = _lit_module(seed=1, optim=optim, steps=epochs * LIT_STEPS)
    fit(resumed, first)
    result["resumed_losses"] = _step_losses(resumed.losses)
    result["resumed_learning_rates"] = resumed.learning_rates[::ACCUM]
    result["resumed_state"] = {k.removeprefix("llama."): v for k, v in hs.full_state_dict(resumed).items()}
    if optim != "sgd":
        return result
    two = _lit_module(seed=0)
    params = list(two.parameters())
    two.configure_optimizers = lambda: [torch.optim.SGD(params[:1], lr=LR), torch.optim.SGD(params[1:], lr=LR)]
    two.automatic_optimization = False  # Lightning's own rule for several optimizers
    try:
        fit(two, None, accumulate_grad_batches=1, gradient_clip_val=None)
        result["two_optimizers"] = "returned"
    except ValueError as e:
        result["two_optimizers"] = str(e).splitlines()[0]
    return result


# Lightning Fabric


def fabric_train(out: str, optim: str = "sgd") -> dict[str, Any]:
    """A Fabric loop over the rows of ``reference`` (``fabric.no_backward_sync`` for accumulation,
    ``fabric.clip_gradients``), ``fabric.save`` after step 2; then a fresh model (other weights)
    ``fabric.load``-ed from it, finishing the run. ``optim``: "sgd" (clipped, constant rate) or "adamw"
    (unclipped, the linear schedule with warm-up saved beside the optimizer: the resume must restore
    both moments and the schedule's step)."""
    import lightning as L

    import hybridshard as hs
    import hybridshard.integrations.fabric  # noqa: F401 - registers strategy="hybridshard" for Fabric
    from hybridshard.integrations.common import sharded_module

    _lightning_env()
    world, local = torch.distributed.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    fabric = L.Fabric(accelerator="cpu", devices=local, num_nodes=world // local, strategy="hybridshard")
    fabric.launch()
    data, width, path = rows(world), ACCUM * world * MICRO, os.path.join(out, "step-2")

    def run(seed: int, resume: bool) -> tuple[list[float], list[float], list[float], Any]:
        model = fabric.setup_module(HF.make_model("llama", seed=seed)[0])
        if optim == "adamw":
            optimizer, schedule = adamw_with_schedule(model.parameters(), STEPS)
            optimizer = fabric.setup_optimizers(optimizer)
        else:
            optimizer, schedule = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=LR)), None
        state = {"model": model, "optimizer": optimizer, "step": 0}
        if schedule is not None:
            state["schedule"] = schedule
        if resume:
            fabric.load(path, state)
        micro_losses, norms, learning_rates = [], [], []
        for step in range(state["step"], STEPS):
            learning_rates.append(optimizer.param_groups[0]["lr"])
            for m in range(ACCUM):
                lo = step * width + m * world * MICRO + fabric.global_rank * MICRO
                with fabric.no_backward_sync(model, enabled=m < ACCUM - 1):
                    loss = model(**{k: v[lo : lo + MICRO] for k, v in data.items()}).loss
                    fabric.backward(loss / ACCUM)
                micro_losses.append(loss.item())
            norms.append(float(fabric.clip_gradients(model, optimizer, max_norm=CLIP if optim == "sgd" else float("inf"))))
            optimizer.step()
            if schedule is not None:
                schedule.step()
            optimizer.zero_grad()
            state["step"] = step + 1
            if state["step"] == 2 and not resume:
                fabric.save(path, state)
        return _step_losses(micro_losses), norms, learning_rates, sharded_module(model)

    losses, norms, learning_rates, model = run(seed=0, resume=False)
    resumed_losses, resumed_norms, resumed_learning_rates, resumed = run(seed=1, resume=True)
    result = {"losses": losses, "norms": norms, "learning_rates": learning_rates, "resumed_norms": resumed_norms,
              "resumed_learning_rates": resumed_learning_rates, "state": hs.full_state_dict(model),
              "resumed_losses": resumed_losses, "resumed_state": hs.full_state_dict(resumed),
              "strategy": type(fabric.strategy).__name__, "units": len(model.hybridshard_runtime.units)}
    if optim != "sgd":
        return result
    before = hs.full_state_dict(resumed)
    try:  # a state naming an entry the checkpoint lacks: refused, the model unchanged
        fabric.load(path, {"model": resumed, "step": 0, "epoch": 0})
        unknown = "returned"
    except ValueError as e:
        unknown = str(e).splitlines()[0]
    after = hs.full_state_dict(resumed)
    unknown += f" | unchanged={all(torch.equal(before[k], after[k]) for k in before)}"
    return {**result, "unknown_entry": unknown}
