"""Rank-side jobs of tests/test_large_models.py: meta init, pretrained loads, exports, state dicts.

Every job builds its model under ``torch.device("meta")`` (tests/hf_models.py's tiny GPT-2 and
Llama), shards it with ``param_init_fn=model._init_weights`` and returns what the test compares
with one plain process.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

import hybridshard as hs
from tests import hf_models as HF
from tests import runtime_models as RM
from tests.live_bytes import LiveTensorBytes

SEED = 5


def meta_model(kind: str) -> tuple[torch.nn.Module, type]:
    with torch.device("meta"):
        return HF.make_model(kind)


def sharded_meta(kind: str, strategy: str, **kw: Any) -> torch.nn.Module:
    model, layer = meta_model(kind)
    return hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={layer}, param_init_fn=model._init_weights,
                    init_seed=SEED, **kw)


def logits(model: torch.nn.Module) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**HF.batch(7, 0, 2)).logits


def init_states(configs: list[tuple[str, str]]) -> list[dict[str, torch.Tensor]]:
    """The full state after meta init, per ``(kind, strategy)``."""
    return [hs.full_state_dict(sharded_meta(kind, strategy)) for kind, strategy in configs]


def load_logits(configs: list[tuple[str, str]], paths: dict[str, str]) -> list[dict[str, Any]]:
    """Meta init, ``load_pretrained``, logits; with the bytes read and the largest unit's bytes."""
    out = []
    for kind, strategy in configs:
        model = sharded_meta(kind, strategy)
        result = hs.load_pretrained(model, paths[kind])
        units = model.hybridshard_runtime.units
        hybrid = [u for u in units if u.groups.replicate_size > 1]
        out.append({
            "logits": logits(model), "result": result,
            "replicate": max((u.groups.replicate_size for u in hybrid), default=1),
            "unit_bytes": max(u.flat.layout.padded_numel * 4 for u in units),
        })
    return out


def export(kind: str, strategy: str, path: str, out: str) -> dict[str, torch.Tensor]:
    """Load, train one step (so the export differs from what was loaded), export; the full state."""
    model = sharded_meta(kind, strategy)
    hs.load_pretrained(model, path)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    model.train()
    model(**HF.batch(0, dist.get_rank(), 2)).loss.backward()
    opt.step()
    full = hs.full_state_dict(model)
    hs.save_pretrained(model, out, config=model.config)
    hs.save_pretrained(model, out + "-bf16", config=model.config, dtype=torch.bfloat16)
    return full


def memory(kind: str, strategy: str, path: str) -> dict[str, int]:
    """Bytes allocated and held during ``shard`` (meta init) and during ``load_pretrained``."""
    model, layer = meta_model(kind)
    with LiveTensorBytes() as live_init:
        hs.shard(model, strategy=strategy, groups=RM.groups(), wrap={layer}, param_init_fn=model._init_weights,
                 init_seed=SEED)
    with LiveTensorBytes() as live_load:
        hs.load_pretrained(model, path)
    units = model.hybridshard_runtime.units
    return {
        "init_peak": live_init.peak(), "load_peak": live_load.peak(),
        "shards": sum(u.flat.layout.shard_numel * 4 for u in units),
        "buffers": sum(b.numel() * b.element_size() for b in model.buffers()),
        "unit": max(sum(s.numel for s in u.flat.layout.slots) * 4 for u in units),
        "gather_buffers": sum(u.flat.layout.shard_numel % u.groups.replicate_size != 0 for u in units),
    }


def refusals() -> dict[str, str]:
    """Every state-dict path of a sharded model raises; the first line of each error, and whether
    the model is unchanged."""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict, get_optimizer_state_dict, set_model_state_dict, set_optimizer_state_dict,
    )

    model = sharded_meta("llama", "HYBRID_SHARD")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    before = hs.full_state_dict(model)
    calls = {
        "state_dict": lambda: model.state_dict(),
        "submodule.state_dict": lambda: model.model.layers[0].state_dict(),
        "load_state_dict": lambda: model.load_state_dict(before),
        "get_model_state_dict": lambda: get_model_state_dict(model),
        "set_model_state_dict": lambda: set_model_state_dict(model, before),
        "get_optimizer_state_dict": lambda: get_optimizer_state_dict(model, opt),
        "set_optimizer_state_dict": lambda: set_optimizer_state_dict(model, opt, {"state": {}, "param_groups": []}),
        "dcp.save": lambda: dcp.save({"model": model}, checkpoint_id=tempfile.mkdtemp(prefix="hs-refused-")),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "returned"
        except ValueError as e:
            out[name] = str(e).splitlines()[0]
    after = hs.full_state_dict(model)
    out["unchanged"] = str(all(torch.equal(before[k], after[k]) for k in before))
    return out


def bad_inputs(tmp: str, paths: dict[str, str]) -> dict[str, str]:
    """First lines of the errors for meta models shard() cannot initialise, and for bad checkpoints."""
    out = {}

    def first_line(fn) -> str:
        try:
            fn()
        except ValueError as e:
            return str(e).splitlines()[0]
        return "returned"

    model, layer = meta_model("llama")
    out["no_init"] = first_line(lambda: hs.shard(model, strategy="FULL_SHARD", wrap={layer}))
    plain, layer = HF.make_model("llama")
    out["init_fn_not_meta"] = first_line(
        lambda: hs.shard(plain, strategy="FULL_SHARD", wrap={layer}, param_init_fn=plain._init_weights))
    model, layer = meta_model("llama")
    out["seeds_differ"] = first_line(lambda: hs.shard(
        model, strategy="FULL_SHARD", wrap={layer}, param_init_fn=model._init_weights, init_seed=dist.get_rank()))
    gpt2 = sharded_meta("gpt2", "FULL_SHARD")
    out["not_a_checkpoint"] = first_line(lambda: hs.load_pretrained(gpt2, tmp))
    llama = sharded_meta("llama", "HYBRID_SHARD")
    before = hs.full_state_dict(llama)
    out["other_model"] = first_line(lambda: hs.load_pretrained(llama, paths["gpt2"]))
    after = hs.full_state_dict(llama)
    out["unchanged"] = str(all(torch.equal(before[k], after[k]) for k in before))
    out["plain"] = first_line(lambda: hs.load_pretrained(HF.make_model("llama")[0], paths["llama"]))
    return out


def optimizer_before_shard(steps: int) -> dict[str, Any]:
    """AdamW on ``hs.param_groups`` built before ``shard`` keeps training the shards."""
    model, layer = HF.make_model("llama")
    groups = hs.param_groups(model, weight_decay=0.1)
    opt = torch.optim.AdamW(groups, lr=1e-2)
    hs.shard(model, strategy="HYBRID_SHARD", groups=RM.groups(), wrap={layer})
    after = hs.param_groups(model, weight_decay=0.1)
    same = [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in after]
    losses = []
    for step in range(steps):
        opt.zero_grad(set_to_none=True)
        loss = model(**HF.batch(step, dist.get_rank(), 2)).loss
        loss.backward()
        opt.step()
        total = loss.detach().reshape(1)
        dist.all_reduce(total)
        losses.append(total.item() / dist.get_world_size())
    return {"same_groups": same, "dims": sorted({p.dim() for p in model.parameters()}),
            "decay": [len(g["params"]) for g in groups], "losses": losses, "state": hs.full_state_dict(model)}
