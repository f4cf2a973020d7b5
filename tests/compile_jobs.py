"""Rank functions for tests/test_compile.py: compiled units against eager units of the same configuration.

CI compiles with ``backend="aot_eager"``: dynamo (which decides frames, graph breaks and recompiles)
and AOTAutograd (which traces forward and backward through the views) run as with inductor, without
inductor's C++ code generation, which would take minutes on two shared cores. The inductor backend
runs in ``hybridshard bench --compile``.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
import torch.nn.functional as F

VOCAB, DIM, LAYERS, HEADS, SEQ, BATCH = 32, 32, 2, 2, 8, 4
BACKEND = {"backend": "aot_eager"}


def _model(checkpoint: bool) -> torch.nn.Module:
    from hybridshard.bench.model import GPT, Block

    torch.manual_seed(0)
    model = GPT(VOCAB, DIM, LAYERS, HEADS, SEQ)
    if checkpoint:  # non-reentrant, around each block (the unit inside the wrapper)
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing

        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, Block))
    return model


def _hf(kind: str) -> tuple[torch.nn.Module, type]:
    """tests/hf_models.py's tiny Llama or GPT-2 with ``use_cache=False`` and SDPA attention, stated."""
    from tests.hf_models import make_model

    model, layer_cls = make_model(kind)
    model.config.use_cache = False
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model, layer_cls


def _loss(model: torch.nn.Module, tokens: torch.Tensor, hf: str) -> torch.Tensor:
    if hf:  # as Hugging Face users train: keyword inputs, the output's loss
        return model(input_ids=tokens, attention_mask=torch.ones_like(tokens), labels=tokens).loss
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))


def _train(compile_options: Any, *, strategy: str, checkpoint: bool, accumulate: bool, steps: int,
           groups: Any = None, hf: str = "", seqs: tuple[int, ...] = (),
           shard_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """``steps`` SGD steps on one batch (so the loss falls); per step the loss and the gradient norm,
    then every full parameter, plus the dynamo counters: frames compiled in step 0 and in all, and
    graph breaks. ``seqs``: a sequence length per step (variable lengths: dynamo recompiles once,
    with a dynamic length, in step 1, so recompiles raise from step 2 on)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import hybridshard as hs
    from hybridshard.bench.model import Block, rank_batch

    torch._dynamo.reset()
    counters.clear()
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model, unit_cls = _hf(hf) if hf else (_model(checkpoint), Block)
    model = hs.shard(model, strategy=strategy, groups=groups, wrap={unit_cls}, device="cpu",
                     compile=compile_options, **(shard_options or {}))
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    losses, norms, first_frames = [], [], 0
    previous = torch._dynamo.config.error_on_recompile
    try:
        for step in range(steps):
            tokens = rank_batch(0, rank, world, seed=1, batch=BATCH * world, seq=SEQ, vocab=VOCAB)
            if seqs:
                tokens = tokens[:, :seqs[step] + 1]
            parts = tokens.chunk(2) if accumulate else [tokens]
            for i, part in enumerate(parts):
                ctx = hs.no_sync(model) if i + 1 < len(parts) else contextlib.nullcontext()
                with ctx:
                    loss = _loss(model, part, hf) / len(parts)
                    loss.backward()
            norms.append(float(hs.clip_grad_norm_(model, max_norm=1e9)))  # never binding: only the norm
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(float(loss.detach()) * len(parts))
            if step == 0:
                first_frames = counters["frames"]["ok"]
            if step == (1 if seqs else 0):
                torch._dynamo.config.error_on_recompile = True  # any recompile from here on raises
    finally:
        torch._dynamo.config.error_on_recompile = previous
    full = hs.full_state_dict(model)
    return {"losses": losses, "norms": norms, "params": full, "first_frames": first_frames,
            "frames": counters["frames"]["ok"], "breaks": sum(counters["graph_break"].values()),
            "break_reasons": dict(counters["graph_break"])}


def compiled_and_eager(*, strategy: str = "FULL_SHARD", checkpoint: bool = False, accumulate: bool = False,
                       steps: int = 3, hybrid: bool = False, hf: str = "",
                       seqs: tuple[int, ...] = (), shard_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The same training compiled and eager; what the test compares (rank 0 and 1 alike)."""
    import hybridshard as hs

    groups = hs.init_groups() if hybrid else None
    kw = dict(strategy=strategy, checkpoint=checkpoint, accumulate=accumulate, steps=len(seqs) or steps,
              groups=groups, hf=hf, seqs=seqs, shard_options=shard_options)
    eager = _train(False, **kw)
    compiled = _train(BACKEND, **kw)
    param_diff = max((compiled["params"][k] - eager["params"][k]).abs().max().item() for k in eager["params"])
    return {
        "eager_losses": eager["losses"], "compiled_losses": compiled["losses"],
        "eager_norms": eager["norms"], "compiled_norms": compiled["norms"],
        "param_max_diff": param_diff, "first_frames": compiled["first_frames"], "frames": compiled["frames"],
        "breaks": compiled["breaks"], "break_reasons": compiled["break_reasons"], "eager_frames": eager["frames"],
        "groups": (groups.shard_size, groups.replicate_size) if groups is not None else None,
    }
