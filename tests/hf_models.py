"""Tiny Hugging Face models built from configs (no download), trained as their users train them.

GPT-2 ties its input embedding to the output head; Llama does not, and adds rotary-embedding
buffers and grouped-query attention (4 query heads over 2 key/value heads). Dropout is off so a
sharded run can be compared with one process exactly. The model is called as users call it:
keyword inputs (``input_ids=``, ``attention_mask=``, ``labels=``) and a dataclass output whose
``loss`` is trained.

Checkpointing forms (``HFConfig.checkpoint``):

- ``"none"``;
- ``"hf"``: ``model.gradient_checkpointing_enable(use_reentrant=False)``, which (in current
  transformers) checkpoints inside each decoder layer's ``forward``, under the unit's hooks;
- ``"hf_reentrant"``: the same with ``use_reentrant=True``;
- ``"wrapper"``: PyTorch's ``apply_activation_checkpointing`` (``checkpoint_wrapper``, what
  torchtitan-style code uses) around each decoder layer, the unit inside the wrapper.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch

VOCAB, SEQ = 64, 8
CHECKPOINTS = ("none", "hf", "hf_reentrant", "wrapper")


@dataclass(frozen=True)
class HFConfig:
    model: str = "gpt2"
    """"gpt2" or "llama"."""
    strategy: str = "HYBRID_SHARD"
    checkpoint: str = "none"
    steps: int = 3
    micro_batch: int = 2
    lr: float = 0.1


def make_model(kind: str, seed: int = 0) -> tuple[torch.nn.Module, type]:
    """The model (train mode) and its decoder-layer class (the wrap unit)."""
    import transformers
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    transformers.logging.set_verbosity_error()
    torch.manual_seed(seed)
    if kind == "gpt2":
        from transformers.models.gpt2.modeling_gpt2 import GPT2Block

        cfg = GPT2Config(
            vocab_size=VOCAB, n_positions=2 * SEQ, n_embd=16, n_layer=2, n_head=2,
            resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=1,
        )
        return GPT2LMHeadModel(cfg).train(), GPT2Block
    if kind == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer

        cfg = LlamaConfig(
            vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2 * SEQ,
            tie_word_embeddings=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
        )
        return LlamaForCausalLM(cfg).train(), LlamaDecoderLayer
    raise ValueError(f"model must be 'gpt2' or 'llama', got {kind!r}")


def enable_checkpointing(model: torch.nn.Module, layer_cls: type, form: str) -> None:
    if form == "none":
        return
    if form in ("hf", "hf_reentrant"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # newer transformers rename the method
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": form == "hf_reentrant"})
        return
    if form == "wrapper":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, layer_cls))
        return
    raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {form!r}")


def make_optimizer(cfg: HFConfig, params) -> torch.optim.Optimizer:
    """SGD with momentum: unlike Adam it does not blow rounding noise up into full steps, which
    matters here because some gradients are zero in exact arithmetic (GPT-2's key bias: softmax
    ignores a constant added to every score), so only their rounding noise is left."""
    return torch.optim.SGD(params, lr=cfg.lr, momentum=0.9)


def batch(step: int, rank: int, micro_batch: int) -> dict[str, torch.Tensor]:
    """Sequences that follow a rule (each token a function of the one before), so the loss falls."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    first = torch.randint(3, VOCAB, (micro_batch, 1), generator=g)
    ids = [first]
    for _ in range(SEQ - 1):
        ids.append((ids[-1] * 5 + 1) % (VOCAB - 3) + 3)
    ids = torch.cat(ids, dim=1)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def _clean(name: str) -> str:
    """State-dict key without ``checkpoint_wrapper``'s prefix (its own state_dict drops it too)."""
    return name.replace("_checkpoint_wrapped_module.", "")


def reference_run(cfg: HFConfig, world_size: int) -> dict[str, Any]:
    """One process, no checkpointing, the global batch (every rank's micro-batch concatenated)."""
    model, _ = make_model(cfg.model)
    opt = make_optimizer(cfg, model.parameters())
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        parts = [batch(step, r, cfg.micro_batch) for r in range(world_size)]
        inputs = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        loss = model(**inputs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        losses.append(loss.item())
    return {"losses": losses, "state": {k: v.clone() for k, v in model.state_dict().items()}}


def sharded_run(cfg: HFConfig) -> dict[str, Any]:
    import torch.distributed as dist

    import hybridshard as hs
    from tests import runtime_models as RM

    rank, world = dist.get_rank(), dist.get_world_size()
    model, layer_cls = make_model(cfg.model)
    enable_checkpointing(model, layer_cls, cfg.checkpoint)
    hs.shard(model, strategy=cfg.strategy, groups=RM.groups(), wrap={layer_cls})
    opt = make_optimizer(cfg, model.parameters())
    losses = []
    for step in range(cfg.steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**batch(step, rank, cfg.micro_batch)).loss
        loss.backward()
        hs.clip_grad_norm_(model, 1.0)
        opt.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / world)
    state = {_clean(k): v for k, v in hs.full_state_dict(model).items()}
    return {"losses": losses, "state": state}


def run_configs(configs: list[HFConfig]) -> list[dict[str, Any]]:
    return [sharded_run(cfg) for cfg in configs]


def generate(kind: str, strategy: str | None, prompt: torch.Tensor, new_tokens: int) -> dict[str, torch.Tensor]:
    """Greedy generation with the KV cache in ``eval()`` under ``no_grad``, then the logits of the result.

    ``strategy=None`` runs the plain model (the reference); otherwise it is sharded first.
    """
    model, layer_cls = make_model(kind)
    if strategy is not None:
        import hybridshard as hs
        from tests import runtime_models as RM

        hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={layer_cls})
    model.eval()
    with torch.no_grad():
        out = model.generate(
            input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
            do_sample=False, use_cache=True, pad_token_id=2,
        )
        logits = model(input_ids=out).logits
    return {"tokens": out, "logits": logits}
