"""Train a tiny Llama with the Hugging Face ``Trainer`` on hybridshard: ``HybridShardTrainer``.

    python examples/hf_trainer.py --workdir /tmp/hf            # spawns 2 simulated nodes x 2 ranks
    python examples/hf_trainer.py --workdir /tmp/hf --resume   # continues from the newest checkpoint
    torchrun --nproc-per-node 8 examples/hf_trainer.py --workdir /tmp/hf   # one real node

The model is built from a config (no download); the data are sequences that follow a rule, so the
loss falls. HYBRID_SHARD (decoder layers as units, groups from the discovered topology), gradient
accumulation over 2 micro-batches, clipping at 1.0, a checkpoint every 4 steps, then
``trainer.save_model()``, which rank 0 reloads with ``from_pretrained`` and compares. Prints one JSON
line with the losses, the seconds of ``train()`` and the largest logit difference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

VOCAB, SEQ, ROWS = 128, 16, 256


class RuleRows(torch.utils.data.Dataset):
    """Each token a function of the one before; ``input_ids`` and ``labels`` as a causal LM takes them."""

    def __init__(self) -> None:
        g = torch.Generator().manual_seed(0)
        ids = [torch.randint(3, VOCAB, (ROWS, 1), generator=g)]
        for _ in range(SEQ - 1):
            ids.append((ids[-1] * 5 + 1) % (VOCAB - 3) + 3)
        self.ids = torch.cat(ids, dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def tiny_llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=2 * SEQ, tie_word_embeddings=False,
        bos_token_id=0, eos_token_id=1, pad_token_id=2))


def main(args: argparse.Namespace) -> None:
    from transformers import TrainingArguments

    from hybridshard.integrations.hf import HybridShardTrainer

    out = os.path.join(args.workdir, "run")
    training = TrainingArguments(
        output_dir=out, max_steps=args.steps, per_device_train_batch_size=4, gradient_accumulation_steps=2,
        learning_rate=3e-3, max_grad_norm=1.0, logging_steps=1, save_steps=4, report_to=[], disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), log_level="warning",
    )
    model = tiny_llama()
    trainer = HybridShardTrainer(model=model, args=training, train_dataset=RuleRows(), strategy="HYBRID_SHARD")
    t0 = time.perf_counter()
    trainer.train(resume_from_checkpoint=True if args.resume else None)
    seconds = time.perf_counter() - t0
    trainer.save_model()  # collective: a directory from_pretrained loads
    losses = [round(h["loss"], 4) for h in trainer.state.log_history if "loss" in h]

    import hybridshard as hs

    sample = RuleRows().ids[:2]
    model.eval()
    with torch.no_grad():
        sharded_logits = model(input_ids=sample.to(next(model.parameters()).device)).logits.cpu()
    if dist.get_rank() == 0:
        from transformers import AutoModelForCausalLM

        with torch.no_grad():
            loaded = AutoModelForCausalLM.from_pretrained(out).eval()(input_ids=sample).logits
        diff = (loaded - sharded_logits).abs().max().item()
        print(json.dumps({"losses": losses, "train_seconds": round(seconds, 2), "export_max_logit_diff": diff,
                          "checkpoints": sorted(d for d in os.listdir(out) if d.startswith("checkpoint-")),
                          "strategy": hs.ShardingStrategy.HYBRID_SHARD.name}), flush=True)
        if diff > 1e-5:
            raise SystemExit(f"the export's logits differ from the sharded model's by {diff}")
    dist.destroy_process_group()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --workdir")
    parsed = parser.parse_args()
    if "RANK" not in os.environ:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from finetune_llama import spawn

        sys.exit(spawn(sys.argv[1:], script=os.path.abspath(__file__)))
    main(parsed)
