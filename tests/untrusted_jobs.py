"""Tampered checkpoints and the rank-side jobs of tests/test_untrusted_checkpoints.py.

Each tampering writes, into a copy of a real checkpoint, a pickle whose loading runs
``touch <marker>`` (``os.system``, as an attacker would): into ``.metadata``, into a bytes entry
(``extra``, ``optim.param_groups``), into an optimizer entry turned into a bytes entry, or in place
of ``hybridshard.json``. A reader that runs it leaves the marker file behind.
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import os
import pathlib
import pickle
import shutil
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

KINDS = ("metadata", "extra", "param_groups", "optim_step", "manifest")


class Payload:
    """Pickles as ``os.system("touch <marker>")``."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Callable[..., Any], tuple[str]]:
        return os.system, (f"touch {self.marker}",)


def _metadata(path: str) -> Any:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return pickle.load(f)  # our own, untampered file


def _write_metadata(path: str, md: Any) -> None:
    with open(os.path.join(path, ".metadata"), "wb") as f:
        pickle.dump(md, f)


def _replace_entry(path: str, key: str, value: Any) -> None:
    """Append ``torch.save(value)`` to the file holding ``key`` and point the metadata at it."""
    md = _metadata(path)
    index = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data.pop(index)
    buf = io.BytesIO()
    torch.save(value, buf)
    file = os.path.join(path, info.relative_path)
    offset = os.path.getsize(file)
    with open(file, "ab") as f:
        f.write(buf.getvalue())
    md.storage_data[dataclasses.replace(index, offset=None, index=None)] = dataclasses.replace(
        info, offset=offset, length=len(buf.getvalue()))
    if not isinstance(md.state_dict_metadata[key], BytesStorageMetadata):  # a tensor entry becomes a bytes one
        for other in [i for i in md.storage_data if i.fqn == key and i.offset is not None]:
            del md.storage_data[other]
        md.state_dict_metadata[key] = BytesStorageMetadata()
    _write_metadata(path, md)


def tamper(src: str, dst: str, kind: str, marker: str) -> str:
    """A copy of the checkpoint ``src`` at ``dst`` carrying the payload in the place ``kind`` names."""
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst)
    if kind == "metadata":
        md = _metadata(dst)
        md.planner_data = {"note": Payload(marker)}
        _write_metadata(dst, md)
    elif kind == "extra":
        _replace_entry(dst, "extra", {"step": 3, "note": Payload(marker)})
    elif kind == "param_groups":
        _replace_entry(dst, "optim.param_groups", [{"lr": 0.1, "params": [], "note": Payload(marker)}])
    elif kind == "optim_step":
        key = next(k for k in _metadata(dst).state_dict_metadata if k.startswith("optim.state.") and k.endswith(".step"))
        _replace_entry(dst, key, Payload(marker))
    elif kind == "manifest":
        with open(os.path.join(dst, "hybridshard.json"), "wb") as f:
            pickle.dump(Payload(marker), f)
    else:
        raise ValueError(f"unknown tampering {kind!r}")
    return dst


def first_line(fn: Callable[[], Any]) -> str:
    """The first line of what ``fn`` raised (``"returned"`` if it did not)."""
    try:
        fn()
    except Exception as exc:  # noqa: BLE001 - the message is what the test compares
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return "returned"


def _same(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> bool:
    common = set(before) & set(after)
    return bool(common) and all(torch.equal(before[k], after[k]) for k in common)


def _tamper_all(src: str, root: str, kinds: tuple[str, ...], marker: str) -> dict[str, str]:
    """Rank 0 writes one tampered copy of ``src`` per kind under ``root``; every rank gets the paths."""
    paths = {kind: os.path.join(root, f"tampered-{kind}") for kind in kinds}
    if dist.get_rank() == 0:
        for kind, dst in paths.items():
            tamper(src, dst, kind, marker)
    dist.barrier()
    return paths


# -- load_checkpoint on 2 nodes x 2 ranks ------------------------------------------------------------


def load_tampered(root: str, marker: str) -> dict[str, Any]:
    """Save a HYBRID_SHARD checkpoint, tamper it every way, load each into a trained model and optimizer."""
    import hybridshard as hs
    from tests import runtime_models as RM

    rank = dist.get_rank()
    model = RM.make_model(0)
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = RM.batch(0, 0, rank, 2)
    RM.lm_loss(model(tokens), tokens).backward()
    opt.step()
    good = os.path.join(root, "good")
    hs.save_checkpoint(good, model, optimizer=opt, extra={"step": 1})
    paths = _tamper_all(good, root, KINDS, marker)

    other = RM.make_model(1)
    hs.shard(other, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={RM.Block})
    other_opt = torch.optim.AdamW(other.parameters(), lr=1e-2)
    RM.lm_loss(other(tokens), tokens).backward()
    other_opt.step()
    before, optim_before = hs.full_state_dict(other), hs.full_optim_state_dict(other, other_opt)
    out: dict[str, Any] = {}
    for kind, path in paths.items():
        out[kind] = first_line(lambda p=path: hs.load_checkpoint(p, other, optimizer=other_opt))
        optim_after = hs.full_optim_state_dict(other, other_opt)
        out[f"{kind} unchanged"] = _same(before, hs.full_state_dict(other)) and all(
            _same(optim_before["state"][n], optim_after["state"][n]) for n in optim_before["state"]
        ) and optim_before["param_groups"] == optim_after["param_groups"]
    out["good"] = hs.load_checkpoint(good, other, optimizer=other_opt)
    out["good loaded"] = _same(hs.full_state_dict(model), hs.full_state_dict(other))
    return out


# -- Hugging Face Trainer -----------------------------------------------------------------------------


class _Rows(torch.utils.data.Dataset):
    def __init__(self, n: int) -> None:
        from tests import hf_models as HF

        self.data = HF.batch(0, 0, n)

    def __len__(self) -> int:
        return len(self.data["input_ids"])

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.data.items()}


def hf_resume_tampered(root: str, marker: str) -> dict[str, Any]:
    """A HybridShardTrainer checkpoint (AdamW, step 2), tampered; a fresh trainer resumes from each copy."""
    from transformers import TrainingArguments

    import hybridshard as hs
    from hybridshard.integrations.hf import CHECKPOINT_DIR, HybridShardTrainer
    from tests import hf_models as HF
    from tests import runtime_models as RM

    world = dist.get_world_size()

    def trainer(seed: int) -> tuple[Any, Any]:
        model, _ = HF.make_model("llama", seed=seed)
        args = TrainingArguments(
            output_dir=root, max_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, optim="adamw_torch",
            lr_scheduler_type="constant", save_strategy="steps", save_steps=2, report_to=[], disable_tqdm=True,
            use_cpu=True, dataloader_num_workers=0, seed=0, train_sampling_strategy="sequential",
        )
        return model, HybridShardTrainer(model=model, args=args, train_dataset=_Rows(4 * world),
                                         strategy="HYBRID_SHARD", groups=RM.groups())

    trainer(0)[1].train()
    checkpoint = os.path.join(root, "checkpoint-2")
    copies = {kind: os.path.join(root, f"resume-{kind}") for kind in ("metadata", "param_groups", "optim_step")}
    if dist.get_rank() == 0:
        for kind, dst in copies.items():
            shutil.copytree(checkpoint, dst, ignore=shutil.ignore_patterns(CHECKPOINT_DIR))
            tamper(os.path.join(checkpoint, CHECKPOINT_DIR), os.path.join(dst, CHECKPOINT_DIR), kind, marker)
    dist.barrier()
    out: dict[str, Any] = {}
    for kind, path in copies.items():
        model, t = trainer(1)
        before = hs.full_state_dict(model)
        out[kind] = first_line(lambda p=path: t.train(resume_from_checkpoint=p))
        out[f"{kind} unchanged"] = _same(before, hs.full_state_dict(model))
    return out


# -- Lightning Trainer --------------------------------------------------------------------------------


def lightning_resume_tampered(root: str, marker: str) -> dict[str, Any]:
    """A HybridShardStrategy checkpoint after one epoch, tampered; a fresh module resumes from each copy."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hybridshard as hs
    from hybridshard.integrations.lightning import HybridShardStrategy
    from hybridshard.state.checkpoint import read_extra
    from tests import hf_models as HF
    from tests import runtime_models as RM

    os.environ.setdefault("TORCHELASTIC_RUN_ID", "hybridshard-tests")  # torchrun's variables for Lightning
    os.environ.setdefault("GROUP_RANK", str(int(os.environ["RANK"]) // int(os.environ["LOCAL_WORLD_SIZE"])))
    os.environ.setdefault("MASTER_PORT", "29500")
    world, local = dist.get_world_size(), int(os.environ["LOCAL_WORLD_SIZE"])
    rows = _Rows(2 * world)
    data = torch.utils.data.DataLoader(rows, batch_size=2,
                                       sampler=torch.utils.data.DistributedSampler(rows, shuffle=False))

    class Lit(L.LightningModule):
        def __init__(self, seed: int) -> None:
            super().__init__()
            self.llama, _ = HF.make_model("llama", seed=seed)
            # Hyperparameters as scripts keep them: made plain when saved.
            self.save_hyperparameters({"seed": seed, "data": pathlib.Path(root), "args": argparse.Namespace(lr=1e-2)})

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            return self.llama(**batch).loss

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    def fit(module: Any, ckpt_path: str | None, epochs: int) -> None:
        L.Trainer(
            strategy=HybridShardStrategy(sharding_strategy="HYBRID_SHARD", groups=RM.groups()), accelerator="cpu",
            devices=local, num_nodes=world // local, max_epochs=epochs, logger=False, enable_progress_bar=False,
            enable_model_summary=False, use_distributed_sampler=False,
            callbacks=[ModelCheckpoint(dirpath=os.path.join(root, "ckpt"), save_top_k=-1)],
        ).fit(module, data, ckpt_path=ckpt_path)

    fit(Lit(0), None, epochs=1)
    saved = os.path.join(root, "ckpt", sorted(os.listdir(os.path.join(root, "ckpt")))[0])
    paths = _tamper_all(saved, root, ("metadata", "extra", "param_groups"), marker)
    out: dict[str, Any] = {"saved extra": read_extra(saved)}
    for kind, path in paths.items():
        module = Lit(1)
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out[kind] = first_line(lambda m=module, p=path: fit(m, p, epochs=2))
        after = hs.full_state_dict(module) if isinstance(module, hs.HybridShardModule) else module.state_dict()
        out[f"{kind} unchanged"] = _same(before, after)
    return out
