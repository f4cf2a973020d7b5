"""The trainers people already run: the Hugging Face ``Trainer`` (``HybridShardTrainer``), Lightning's
``Trainer`` (``HybridShardStrategy``) and Fabric (``HybridShardFabricStrategy``) on 2 simulated nodes x 2 ranks, with the tiny Llama of
tests/hf_models.py built from a config, against one plain process on the same rows.

Every run accumulates gradients over 2 micro-batches; a checkpoint taken half-way is resumed by a
fresh trainer whose model starts from other weights. A clip at a norm the gradients exceed, or AdamW,
gives the same update for a gradient off by a constant factor (summed over ranks or micro-batches
instead of averaged), so in each library one run sees the scale: the gradient norm the system reports
is compared with the reference's (HF Trainer's logged ``grad_norm``, Fabric's ``clip_gradients``), and
one run trains unclipped (Lightning's SGD). In each library one run trains with AdamW on a linear
schedule with warm-up (unclipped): its resume must restore both moments and the schedule's step. One
pool runs every job (tests/integration_jobs.py).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import pytest
import torch

from tests import hf_models as HF
from tests import integration_jobs as J
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
TOL = 1e-5
HF_STRATEGIES = ("HYBRID_SHARD", "FULL_SHARD")
HF_OPTIM = {"HYBRID_SHARD": "sgd", "FULL_SHARD": "adamw"}
"""HF runs: clipped SGD at a constant rate, and unclipped AdamW on a linear schedule."""
LIGHTNING_RUNS = ("hybridshard", "instance:FULL_SHARD", "hybridshard_zero2")
"""Lightning runs: the registered names "hybridshard" (HYBRID_SHARD) and "hybridshard_zero2" (HYBRID_SHARD_ZERO2),
and a HybridShardStrategy(sharding_strategy="FULL_SHARD")."""
LIGHTNING_CLIP = {"hybridshard": J.CLIP, "instance:FULL_SHARD": None, "hybridshard_zero2": None}
LIGHTNING_OPTIM = {"hybridshard": "sgd", "instance:FULL_SHARD": "sgd", "hybridshard_zero2": "adamw"}
FABRIC_RUNS = ("sgd", "adamw")
"""Fabric runs: clipped SGD at a constant rate, and unclipped AdamW on a linear schedule."""


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("integrations")
    out = {"dirs": {}}
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        for s in HF_STRATEGIES:
            out["dirs"][s] = str(root / f"hf-{s}")
            out[s] = pool.run(J.hf_train, s, out["dirs"][s], HF_OPTIM[s])
        out["hf_errors"] = pool.run(J.hf_errors, str(root / "hf-errors"))[0]
        for name in LIGHTNING_RUNS:
            out["dirs"][name] = str(root / f"lightning-{name.replace(':', '-')}")
            out[name] = pool.run(J.lightning_train, name, out["dirs"][name], clip=LIGHTNING_CLIP[name],
                                 optim=LIGHTNING_OPTIM[name])
        for optim in FABRIC_RUNS:
            out["dirs"][f"fabric-{optim}"] = str(root / f"fabric-{optim}")
            out[f"fabric-{optim}"] = pool.run(J.fabric_train, out["dirs"][f"fabric-{optim}"], optim)
    return out


@pytest.fixture(scope="module")
def reference():
    steps, epochs = list(range(J.STEPS)), [0, 1] * (J.STEPS // 2)
    with RM.single_thread():
        return {"sgd": J.reference(WORLD, steps), "adamw": J.reference(WORLD, steps, clip=None, optim="adamw"),
                "hybridshard": J.reference(WORLD, epochs), "instance:FULL_SHARD": J.reference(WORLD, epochs, clip=None),
                "hybridshard_zero2": J.reference(WORLD, epochs, clip=None, optim="adamw")}


def _max_diff(state: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> float:
    assert set(state) == set(ref), set(state) ^ set(ref)
    return max((state[k] - ref[k]).abs().max().item() for k in ref)


def _check_parity(losses: list[float], state: dict[str, torch.Tensor], ref: dict, norms: list[float] | None = None) -> None:
    assert losses == pytest.approx(ref["losses"], abs=TOL)
    assert _max_diff(state, ref["state"]) <= TOL
    assert losses[-1] < losses[0]  # it trains
    if norms is not None:  # the total gradient norm before clipping, as the system reports it
        assert norms == pytest.approx(ref["norms"], rel=TOL, abs=TOL)


# Hugging Face Trainer


@pytest.mark.parametrize("strategy", HF_STRATEGIES)
def test_hf_trainer_matches_one_process(runs, reference, strategy):
    ref = reference[HF_OPTIM[strategy]]
    for rank, r in enumerate(runs[strategy]):
        _check_parity(r["losses"], r["state"], ref, norms=r["grad_norms"])
        assert r["ddp"] == "HybridShardLlamaForCausalLM", f"rank {rank}: the Trainer wrapped the model in {r['ddp']}"
        assert r["units"] == 3  # two decoder layers (the default: _no_split_modules) and the root


def test_hf_clipping_is_on(reference):
    """The clip threshold is below the gradient norm of every step, so the SGD run's parity covers clipping."""
    model, _ = HF.make_model("llama")
    data = J.rows(WORLD)
    width = J.ACCUM * WORLD * J.MICRO
    loss = model(**{k: v[:width] for k, v in data.items()}).loss
    loss.backward()
    assert torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")) > 1.5 * J.CLIP
    assert min(reference["sgd"]["norms"]) > J.CLIP


def test_adamw_schedule_changes_across_the_resume(reference):
    """The AdamW runs' rates differ before and after the checkpoint at step 2, and on the two steps after it.

    A resume that restores the optimizer but not the schedule runs step 2 at the optimizer's saved rate,
    then restarts the schedule: step 3 gets the factor of step 1. That must differ from step 3's own."""
    rates = [J.linear_lr(step, J.STEPS) for step in range(J.STEPS)]
    assert rates == pytest.approx([0.0, 1.0, 2 / 3, 1 / 3], rel=1e-12)
    assert rates[1] != rates[3]
    for ref in (reference["adamw"], reference["hybridshard_zero2"]):
        assert ref["learning_rates"] == pytest.approx([J.ADAMW_LR * r for r in rates], rel=1e-12)


@pytest.mark.parametrize("strategy", HF_STRATEGIES)
def test_hf_save_model_loads_with_from_pretrained(runs, strategy):
    from transformers import AutoModelForCausalLM

    out = runs["dirs"][strategy]
    assert runs[strategy][0]["checkpoints"] == ["checkpoint-2", "checkpoint-4"]  # kept by the export beside them
    with RM.single_thread():
        loaded = AutoModelForCausalLM.from_pretrained(out)
        logits = J.logits_of(loaded)
    assert torch.allclose(logits, runs[strategy][0]["logits"], atol=TOL, rtol=0)
    for rank, r in enumerate(runs[strategy]):
        assert torch.equal(r["logits"], runs[strategy][0]["logits"]), rank
    manifest = json.load(open(os.path.join(out, "checkpoint-2", "hybridshard", "hybridshard.json")))
    assert manifest["optimizer"] is not None


@pytest.mark.parametrize("strategy", HF_STRATEGIES)
def test_hf_resume_continues_with_the_same_losses(runs, reference, strategy):
    ref = reference[HF_OPTIM[strategy]]
    for r in runs[strategy]:
        # The log of a resumed run starts with the checkpoint's own steps; the rest it trained itself.
        assert r["resumed_losses"] == pytest.approx(ref["losses"], abs=TOL)
        assert r["resumed_grad_norms"] == pytest.approx(ref["norms"], rel=TOL, abs=TOL)
        assert r["resumed_learning_rates"] == r["learning_rates"]  # the schedule went on from its step
        assert _max_diff(r["resumed_state"], ref["state"]) <= TOL
        if HF_OPTIM[strategy] == "sgd":
            # From a checkpoint holding only the export (save_only_model): weights through hs.load_pretrained.
            # Plain SGD keeps no optimizer state, so only this run can continue exactly from the weights.
            assert _max_diff(r["model_only_state"], ref["state"]) <= TOL


def test_hf_refuses_what_it_cannot_keep(runs):
    errors = runs["hf_errors"]
    assert "needs model=" in errors["no_model"] and "model_init is not supported" in errors["no_model"]
    assert "needs args=" in errors["no_args"]
    assert "TrainingArguments(bf16=True)" in errors["bf16"] and "MixedPrecision" in errors["bf16"]
    assert "load_best_model_at_end=True" in errors["best"]


# Lightning


@pytest.mark.parametrize("run", LIGHTNING_RUNS)
def test_lightning_fit_matches_one_process(runs, reference, run):
    for r in runs[run]:
        _check_parity(r["losses"], r["state"], reference[run])
        assert r["strategy"] == "HybridShardStrategy" and r["global_step"] == J.STEPS
        assert r["units"] == 3


@pytest.mark.parametrize("run", LIGHTNING_RUNS)
def test_lightning_resume_continues_with_the_same_losses(runs, reference, run):
    ref = reference[run]
    ckpts = runs[run][0]["checkpoints"]
    assert ckpts == ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt"]
    manifest = json.load(open(os.path.join(runs["dirs"][run], ckpts[0], "hybridshard.json")))
    assert manifest["optimizer"] is not None and manifest["extra"]
    for r in runs[run]:
        assert r["resumed_losses"] == pytest.approx(ref["losses"][J.LIT_STEPS:], abs=TOL)
        assert _max_diff(r["resumed_state"], ref["state"]) <= TOL
        # The rate of every step, the resumed ones included: the schedule went on from its step.
        assert r["learning_rates"] == pytest.approx(ref["learning_rates"], rel=1e-12)
        assert r["resumed_learning_rates"] == pytest.approx(ref["learning_rates"][J.LIT_STEPS:], rel=1e-12)


def test_lightning_takes_one_optimizer(runs):
    assert "one optimizer, but configure_optimizers returned 2" in runs["hybridshard"][0]["two_optimizers"]


def test_refusals_before_any_collective(tmp_path):
    """The argument checks that need no process group, each with its first line."""
    import hybridshard as hs
    from hybridshard.integrations.common import shard_model, sharded_module
    from hybridshard.integrations.fabric import HybridShardFabricStrategy
    from hybridshard.integrations.lightning import HybridShardStrategy

    with pytest.raises(RuntimeError, match="initialised default process group.*torchrun"):
        shard_model(torch.nn.Linear(2, 2), strategy="FULL_SHARD", wrap=None, groups=None, shard_kwargs={})
    with pytest.raises(ValueError, match="holds no sharded module"):
        sharded_module(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="takes no storage_options"):
        HybridShardStrategy().save_checkpoint({}, "ckpt", storage_options={"x": 1})
    hs.save_checkpoint(tmp_path / "plain", torch.nn.Linear(2, 2))  # one plain process; no extra
    with pytest.raises(ValueError, match="without Lightning's state"):
        HybridShardStrategy().load_checkpoint(tmp_path / "plain")
    fabric = HybridShardFabricStrategy()
    with pytest.raises(ValueError, match="neither storage_options nor filter"):
        fabric.save_checkpoint("ckpt", {}, filter={"model": lambda k, v: True})
    with pytest.raises(ValueError, match="loads into a state dict"):
        fabric.load_checkpoint("ckpt", state=None)
    with pytest.raises(ValueError, match="one sharded module and at most one optimizer.*2 modules"):
        fabric.save_checkpoint("ckpt", {"a": torch.nn.Linear(2, 2), "b": torch.nn.Linear(2, 2)})


def test_lightning_registers_the_strategy_names():
    from lightning.pytorch.strategies import StrategyRegistry

    import hybridshard as hs
    from hybridshard.integrations.lightning import HybridShardStrategy

    for name, strategy in (("hybridshard", "HYBRID_SHARD"), ("hybridshard_zero2", "HYBRID_SHARD_ZERO2"),
                           ("hybridshard_full_shard", "FULL_SHARD"), ("hybridshard_no_shard", "NO_SHARD")):
        made = StrategyRegistry.get(name)
        assert isinstance(made, HybridShardStrategy) and made.sharding_strategy is hs.ShardingStrategy[strategy]


def test_lightning_refuses_other_precisions():
    from lightning.pytorch.plugins.precision import HalfPrecision

    from hybridshard.integrations.lightning import HybridShardPrecision, HybridShardStrategy

    assert isinstance(HybridShardStrategy().precision_plugin, HybridShardPrecision)
    with pytest.raises(ValueError, match=r"32-bit.*HalfPrecision.*bf16-true.*mixed_precision"):
        HybridShardStrategy(precision_plugin=HalfPrecision("bf16-true"))


# Lightning Fabric


@pytest.mark.parametrize("optim", FABRIC_RUNS)
def test_fabric_matches_one_process_and_resumes(runs, reference, optim):
    ref = reference[optim]  # the same rows in the same steps
    for r in runs[f"fabric-{optim}"]:
        _check_parity(r["losses"], r["state"], ref, norms=r["norms"])
        assert r["resumed_norms"] == pytest.approx(ref["norms"][2:], rel=TOL, abs=TOL)
        assert r["strategy"] == "HybridShardFabricStrategy" and r["units"] == 3
        assert r["resumed_losses"] == pytest.approx(ref["losses"][2:], abs=TOL)
        assert _max_diff(r["resumed_state"], ref["state"]) <= TOL
        assert r["learning_rates"] == pytest.approx(ref["learning_rates"], rel=1e-12)
        assert r["resumed_learning_rates"] == pytest.approx(ref["learning_rates"][2:], rel=1e-12)
    manifest = json.load(open(os.path.join(runs["dirs"][f"fabric-{optim}"], "step-2", "hybridshard.json")))
    assert manifest["optimizer"] is not None and manifest["extra"]
    if optim == "adamw":
        return
    assert "names ['epoch'], which" in runs["fabric-sgd"][0]["unknown_entry"]
    assert runs["fabric-sgd"][0]["unknown_entry"].endswith("unchanged=True")


def test_fabric_registers_the_names_and_refuses_other_precisions():
    from lightning.fabric.plugins.precision import HalfPrecision
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    import hybridshard as hs
    from hybridshard.integrations.fabric import HybridShardFabricStrategy

    made = STRATEGY_REGISTRY.get("hybridshard_full_shard")
    assert isinstance(made, HybridShardFabricStrategy) and made.sharding_strategy is hs.ShardingStrategy.FULL_SHARD
    strategy = HybridShardFabricStrategy(precision=HalfPrecision("bf16-true"))
    with pytest.raises(ValueError, match=r"32-bit.*HalfPrecision.*mixed_precision"):
        strategy.setup_module(torch.nn.Linear(2, 2))


# All


@pytest.mark.parametrize("module,library,extra", [
    ("hybridshard.integrations.lightning", "lightning", "lightning"),
    ("hybridshard.integrations.fabric", "lightning", "lightning"),
    ("hybridshard.integrations.hf", "accelerate", "hf"),
])
def test_a_missing_library_names_the_extra(monkeypatch, module, library, extra):
    monkeypatch.setitem(sys.modules, library, None)  # makes `import library` raise ImportError
    monkeypatch.delitem(sys.modules, module, raising=False)
    with pytest.raises(ImportError, match=rf"pip install 'hybridshard\[{extra}\]'"):
        importlib.import_module(module)


def test_default_units_are_the_decoder_layers():
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    from hybridshard.integrations.common import layer_classes

    model, _ = HF.make_model("llama")
    assert layer_classes(model) == {LlamaDecoderLayer}
    assert layer_classes(torch.nn.Linear(2, 2)) == set()

    class Named(torch.nn.Module):
        _no_split_modules = ["Missing"]

    with pytest.raises(ValueError, match=r"_no_split_modules names \['Missing'\].*pass wrap="):
        layer_classes(Named())
