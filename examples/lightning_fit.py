"""Train a tiny Llama with Lightning's ``Trainer`` on hybridshard: ``strategy="hybridshard"``.

    python examples/lightning_fit.py --workdir /tmp/lit            # spawns 2 simulated nodes x 2 ranks
    python examples/lightning_fit.py --workdir /tmp/lit --resume   # continues from last.ckpt
    torchrun --nproc-per-node 8 examples/lightning_fit.py --workdir /tmp/lit --devices 8   # one real node

The ``LightningModule`` holds a Llama built from a config (no download) and trains on the rule
sequences of examples/hf_trainer.py. ``import hybridshard.integrations.lightning`` registers the
strategy names; ``"hybridshard"`` is HYBRID_SHARD with the decoder layers as units and the groups
from the discovered topology. Gradient accumulation over 2 micro-batches, clipping at 1.0, a
sharded checkpoint per epoch plus ``last.ckpt``. Prints one JSON line with each epoch's mean loss
and the seconds of ``fit``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hf_trainer import RuleRows, tiny_llama  # noqa: E402 - the same model and data


def main(args: argparse.Namespace) -> None:
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    import hybridshard.integrations.lightning  # noqa: F401 - registers strategy="hybridshard"

    class LitLlama(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.llama = tiny_llama()
            self.epoch_losses: list[float] = []
            self._sum = 0.0
            self._count = 0

        def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
            loss = self.llama(**batch).loss
            self._sum, self._count = self._sum + loss.item(), self._count + 1
            return loss

        def on_train_epoch_end(self) -> None:
            mean = torch.tensor(self._sum / max(self._count, 1))
            self.epoch_losses.append(round(self.trainer.strategy.reduce(mean).item(), 4))
            self._sum, self._count = 0.0, 0

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=3e-3)

    module = LitLlama()
    data = torch.utils.data.DataLoader(RuleRows(), batch_size=4)
    trainer = L.Trainer(
        strategy="hybridshard", accelerator="gpu" if torch.cuda.is_available() else "cpu", devices=args.devices,
        num_nodes=int(os.environ["WORLD_SIZE"]) // args.devices, max_epochs=args.epochs,
        accumulate_grad_batches=2, gradient_clip_val=1.0, logger=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[ModelCheckpoint(dirpath=os.path.join(args.workdir, "ckpt"),
                                                               save_top_k=-1, save_last=True)],
    )
    t0 = time.perf_counter()
    trainer.fit(module, data, ckpt_path="last" if args.resume else None)
    seconds = time.perf_counter() - t0
    if trainer.is_global_zero:
        print(json.dumps({"epoch_losses": module.epoch_losses, "global_step": trainer.global_step,
                          "fit_seconds": round(seconds, 2),
                          "checkpoints": sorted(os.listdir(os.path.join(args.workdir, "ckpt")))}), flush=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--devices", type=int, default=2, help="processes per node")
    parser.add_argument("--resume", action="store_true", help="continue from last.ckpt in --workdir")
    parsed = parser.parse_args()
    if "RANK" not in os.environ:
        from finetune_llama import spawn

        # torchrun sets these two as well; Lightning reads them to see it was launched from outside
        sys.exit(spawn(sys.argv[1:], script=os.path.abspath(__file__), env={"TORCHELASTIC_RUN_ID": "example"}))
    main(parsed)
