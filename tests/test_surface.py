"""The public surface (docs/api.md): the handle class ``shard`` gives a model, its methods against the
functions they stand for, the option enums and config records, and every old name as an alias.
The class and option checks run in this process; the methods run on one 2-rank gloo pool."""

from __future__ import annotations

import copy
import importlib
import json
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import hybridshard as hs
from hybridshard.handle import HybridShardModule, handle_class
from hybridshard.options import CheckConfig, CommConfig, Compression, Executor, InitConfig, split_keywords
from tests import hf_models as HF
from tests import runtime_models as RM
from tests.mp import RankPool

# Every name ``hybridshard.__all__`` held before the surface, and where it lives now.
ALIASES = {
    "CPUOffload": "hybridshard.CPUOffload",
    "MixedPrecision": "hybridshard.MixedPrecision",
    "ShardedGradScaler": "hybridshard.ShardedGradScaler",
    "ShardingStrategy": "hybridshard.ShardingStrategy",
    "materialize": "hybridshard.materialize",
    "param_groups": "hybridshard.param_groups",
    "FaultTolerance": "hybridshard.FaultTolerance",
    "shard": "hybridshard.shard",
    "ShardGroups": "hybridshard.ShardGroups",
    "init_groups": "hybridshard.init_groups",
    "FlatLayout": "hybridshard.runtime.units.layout.FlatLayout",
    "ShardedState": "hybridshard.runtime.units.unit.ShardedState",
    "TrainingState": "hybridshard.runtime.units.unit.TrainingState",
    "no_sync": "hybridshard.runtime.engine.no_sync",
    "clip_grad_norm_": "hybridshard.runtime.optim.grad_norm.clip_grad_norm_",
    "gather_updated_params": "hybridshard.runtime.optim.replica_slices.gather_updated_params",
    "param_shapes": "hybridshard.state.shapes.param_shapes",
    "SaveResult": "hybridshard.checkpoint.SaveResult",
    "LoadResult": "hybridshard.checkpoint.LoadResult",
    "UnsafeCheckpointError": "hybridshard.checkpoint.UnsafeCheckpointError",
    "save_checkpoint": "hybridshard.checkpoint.save",
    "load_checkpoint": "hybridshard.checkpoint.load",
    "latest_checkpoint": "hybridshard.checkpoint.latest",
    "full_state_dict": "hybridshard.checkpoint.full_state_dict",
    "load_full_state_dict": "hybridshard.checkpoint.load_full_state_dict",
    "full_optim_state_dict": "hybridshard.checkpoint.full_optim_state_dict",
    "load_full_optim_state_dict": "hybridshard.checkpoint.load_full_optim_state_dict",
    "save_pretrained": "hybridshard.checkpoint.save_pretrained",
    "load_pretrained": "hybridshard.checkpoint.load_pretrained",
    "ReplicaDivergence": "hybridshard.debug.ReplicaDivergence",
    "check_replicas": "hybridshard.debug.check_replicas",
    "maybe_check_replicas": "hybridshard.debug.maybe_check_replicas",
    "comm_stats": "hybridshard.debug.comm_stats",
    "count_collectives": "hybridshard.debug.count_collectives",
    "record_issue_order": "hybridshard.debug.record_issue_order",
}

SURFACE = {"shard", "HybridShardModule", "init_groups", "ShardGroups", "ShardingStrategy", "MixedPrecision",
           "CPUOffload", "CommConfig", "CheckConfig", "InitConfig", "Executor", "Compression", "ShardedGradScaler",
           "materialize", "param_groups", "FaultTolerance", "checkpoint", "debug"}

# Each handle method and the function it stands for (checked in test_methods_match_the_functions).
METHODS = {
    "no_sync": "hybridshard.runtime.engine.no_sync",
    "set_requires_gradient_sync": None,  # FSDP2's form of no_sync: no function of its own
    "clip_grad_norm_": "hybridshard.runtime.optim.grad_norm.clip_grad_norm_",
    "full_state_dict": "hybridshard.checkpoint.full_state_dict",
    "load_full_state_dict": "hybridshard.checkpoint.load_full_state_dict",
    "full_optim_state_dict": "hybridshard.checkpoint.full_optim_state_dict",
    "load_full_optim_state_dict": "hybridshard.checkpoint.load_full_optim_state_dict",
    "check_replicas": "hybridshard.debug.check_replicas",
    "comm_stats": "hybridshard.debug.comm_stats",
    "gather_updated_params": "hybridshard.runtime.optim.replica_slices.gather_updated_params",
    "param_shapes": "hybridshard.state.shapes.param_shapes",
}


def _resolve(path: str):
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# -- in this process: names, classes, options ---------------------------------------------------------


@pytest.mark.parametrize("old", sorted(ALIASES))
def test_every_old_name_is_the_same_object(old):
    assert getattr(hs, old) is _resolve(ALIASES[old]), old
    namespace = {}
    exec(f"from hybridshard import {old}", namespace)
    assert namespace[old] is _resolve(ALIASES[old])


def test_all_is_the_new_surface():
    assert set(hs.__all__) == SURFACE and len(hs.__all__) == len(SURFACE)
    assert not {"FlatLayout", "ShardedState", "TrainingState", "record_issue_order"} & set(hs.__all__)
    for namespace in (hs.checkpoint, hs.debug):
        assert all(getattr(namespace, n) is not None for n in namespace.__all__)


def test_handle_class_is_made_once_per_class():
    cls = handle_class(RM.TinyLM)
    assert cls.__name__ == "HybridShardTinyLM" and cls.__mro__[1:3] == (HybridShardModule, RM.TinyLM)
    assert handle_class(RM.TinyLM) is cls and handle_class(cls) is cls
    assert handle_class(nn.Linear) is not cls and handle_class(nn.Linear).__name__ == "HybridShardLinear"


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_handle_methods_leave_hf_names_alone(kind):
    """The methods shadow nothing a Hugging Face model or ``nn.Module`` has (HF's ``save_pretrained`` stays HF's)."""
    model, _ = HF.make_model(kind)
    ours = {n for n in vars(HybridShardModule) if not n.startswith("_")}
    assert ours == {*METHODS, "hybridshard_runtime"}
    assert not ours & set(dir(type(model))), ours & set(dir(type(model)))


def test_handle_methods_leave_lightning_names_alone():
    lightning = pytest.importorskip("lightning.pytorch")
    ours = {n for n in vars(HybridShardModule) if not n.startswith("_")}
    assert not ours & set(dir(lightning.LightningModule))


def test_options_take_enums_and_strings():
    assert CommConfig(executor="Threads") == CommConfig(executor=Executor.THREADS)
    assert CommConfig(executor="threads").executor is Executor.THREADS and Executor.THREADS == "threads"
    assert CommConfig(replicate_compression="bf16").replicate_compression is Compression.BF16
    assert CommConfig(replicate_compression="none").replicate_compression is Compression.NONE
    assert CommConfig().executor is None and CheckConfig().debug is None
    folded = split_keywords({}, {"prefetch": 2, "executor": "streams", "check_steps": False, "init_seed": 3})
    assert folded == {"comm": CommConfig(prefetch=2, executor=Executor.STREAMS),
                      "checks": CheckConfig(check_steps=False), "init": InitConfig(init_seed=3)}
    given = {"comm": CommConfig(prefetch=0), "checks": None, "init": None}
    assert split_keywords(given, {})["comm"] is given["comm"]


@pytest.mark.parametrize("make, first_line", [
    (lambda: CommConfig(executor="thread"),
     "executor expects hybridshard.Executor or one of 'auto', 'threads', 'streams', 'emulate', found 'thread'; "
     "pass e.g. executor=hybridshard.Executor.AUTO or executor='auto'"),
    (lambda: CommConfig(replicate_compression="fp8"),
     "replicate_compression expects hybridshard.Compression or one of 'none', 'bf16', 'int8', found 'fp8'; pass e.g."),
    (lambda: CommConfig(prefetch=-1), "CommConfig.prefetch expects a count of units >= 0, found -1; pass prefetch=1"),
    (lambda: CommConfig(overlap_grads="yes"),
     "CommConfig.overlap_grads expects True or False, found 'yes'; pass overlap_grads=True"),
    (lambda: CheckConfig(debug=1), "CheckConfig.debug expects True, False or None, found 1; pass debug=True"),
    (lambda: InitConfig(init_seed="7"), "InitConfig.init_seed expects an int or None, found '7'; pass e.g."),
    (lambda: InitConfig(param_init_fn=3), "InitConfig.param_init_fn expects a callable taking a module, found 3;"),
    (lambda: split_keywords({"comm": CommConfig()}, {"prefetch": 2}),
     "shard() expects prefetch once, found it both as a keyword and in comm=CommConfig(...); pass it in one place"),
    (lambda: split_keywords({"checks": {"debug": True}}, {}),
     "checks= expects a hybridshard.CheckConfig, found {'debug': True}; pass checks=hybridshard.CheckConfig(...)"),
    (lambda: hs.ShardingStrategy.parse("zero3"), "strategy must be a ShardingStrategy or one of FULL_SHARD"),
])
def test_bad_option_names_expected_found_fix(make, first_line):
    with pytest.raises(ValueError) as info:
        make()
    assert str(info.value).splitlines()[0].startswith(first_line), str(info.value)
    assert " pass " in str(info.value).splitlines()[0]


def test_unknown_keyword_is_a_type_error():
    with pytest.raises(TypeError, match=r"^shard\(\) got an unexpected keyword argument 'prefech'"):
        split_keywords({}, {"prefech": 1})


# -- on two ranks: the methods do what the functions do ----------------------------------------------


@pytest.fixture(scope="module")
def pool():
    with RankPool(2, num_nodes=2) as p:
        yield p


def _grad_norm(model: nn.Module) -> float:
    return torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])).item()


def check_methods() -> dict:
    """FULL_SHARD over both ranks, every rank on the same batches, against one plain model."""
    ref, model = RM.make_model(), RM.make_model()
    out = hs.shard(model, strategy="FULL_SHARD", wrap={RM.Block}, comm=CommConfig(executor=Executor.THREADS, replicate_compression=Compression.BF16),
                   checks=CheckConfig(check_steps=True))
    assert out is model and isinstance(model, hs.HybridShardModule) and isinstance(model, RM.TinyLM)
    assert type(model).__name__ == "HybridShardTinyLM"
    assert model.hybridshard_runtime is model._hybridshard_runtime
    twin = hs.shard(RM.make_model(), strategy="FULL_SHARD", wrap={RM.Block}, prefetch=0, executor="threads",
                    replicate_compression="BF16")  # the old keywords, strings for the enums
    assert type(twin) is type(model), "sharding the same class twice reuses the class"
    runtimes = (model.hybridshard_runtime, twin.hybridshard_runtime)
    assert [r.prefetch_depth for r in runtimes] == [1, 0]
    assert [r.compressor.mode for r in runtimes] == ["bf16", "bf16"]
    assert type(runtimes[0].executor) is type(runtimes[1].executor)
    with pytest.raises(TypeError, match=r"^pickle expects a plain module, found a sharded HybridShardTinyLM"):
        pickle.dumps(model)
    with pytest.raises(TypeError, match=r"^pickle expects a plain module"):
        copy.deepcopy(model)

    first, second = RM.batch(0, 0, 0, 2), RM.batch(0, 1, 0, 2)
    for t in (first, second):
        RM.lm_loss(ref(t), t).backward()
    with hs.debug.count_collectives() as held:
        with model.no_sync():
            RM.lm_loss(model(first), first).backward()
    RM.lm_loss(model(second), second).backward()
    reduced = {k: v for k, v in held.calls.items() if k[0] in ("reduce_scatter", "all_reduce")}
    gathered = sum(v for k, v in held.calls.items() if k[0] == "all_gather")
    ref_norm = _grad_norm(ref)
    unclipped = model.clip_grad_norm_(1e9).item()
    again = hs.clip_grad_norm_(model, 1e9, 2.0).item()
    inf_norm = model.clip_grad_norm_(1e9, float("inf")).item()
    ref_inf = max(p.grad.abs().max().item() for p in ref.parameters() if p.grad is not None)
    clipped = model.clip_grad_norm_(0.5 * ref_norm).item()
    after = hs.clip_grad_norm_(model, 1e9).item()
    with hs.debug.count_collectives() as held_by_switch:
        twin.set_requires_gradient_sync(False)  # FSDP2's form of the block, on the twin
        RM.lm_loss(twin(first), first).backward()
    twin.set_requires_gradient_sync(True)
    RM.lm_loss(twin(second), second).backward()
    switch = {"reduced": sum(v for k, v in held_by_switch.calls.items() if k[0] in ("reduce_scatter", "all_reduce")),
              "norm": twin.clip_grad_norm_(1e9).item()}
    with pytest.raises(ValueError, match=r"^set_requires_gradient_sync expects True or False, found 0"):
        twin.set_requires_gradient_sync(0)
    with twin.no_sync(), hs.no_sync(twin):  # as accelerate's model.no_sync around a Trainer's own block
        assert twin.hybridshard_runtime.sync_mode.name == "LOCAL"
    assert twin.hybridshard_runtime.sync_mode.name == "SYNC"
    with pytest.raises(ValueError, match=r"^no_sync\(reduce_scatter=True\) expects no open block or one of the same "
                       r"kind, found one with reduce_scatter=False; leave"):
        with twin.no_sync(), twin.no_sync(reduce_scatter=True):
            pass
    assert twin.hybridshard_runtime.sync_mode.name == "SYNC"

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    opt.step()
    state = model.full_state_dict()
    same_state = all(torch.equal(v, hs.full_state_dict(model)[k]) for k, v in state.items())
    optim_state = model.full_optim_state_dict(opt)
    same_optim = optim_state.keys() == hs.full_optim_state_dict(model, opt).keys()
    model.load_full_state_dict({k: v + 1 if v.is_floating_point() else v for k, v in state.items()})
    moved = all(torch.equal(v + 1, model.full_state_dict()[k]) for k, v in state.items() if v.is_floating_point())
    model.load_full_optim_state_dict(opt, optim_state)
    model.gather_updated_params()  # no slices: nothing to gather
    return {"reduced_in_no_sync": sum(reduced.values()), "gathered_in_no_sync": gathered, "ref_norm": ref_norm, "unclipped": unclipped,
            "again": again, "inf": inf_norm, "ref_inf": ref_inf, "clipped": clipped, "after": after,
            "steps": model.comm_stats()["steps"], "switch": switch, "same": same_state and same_optim, "moved": moved,
            "shapes": model.param_shapes() == hs.param_shapes(model) == {n: tuple(p.shape) for n, p in
                                                                         ref.named_parameters()}}


def check_replicas_method() -> list[str]:
    """HYBRID_SHARD (1 x 2): one rank's shard changed, and ``model.check_replicas()`` names it."""
    model = hs.shard(RM.make_model(), groups=RM.groups(), wrap={RM.Block})
    found = []
    for corrupt in (False, True):
        if corrupt and dist.get_rank() == 1:
            with torch.no_grad():
                model.hybridshard_runtime.units[1].flat.sharded[3] += 1e-3
        try:
            model.check_replicas()
            found.append("ok")
        except hs.debug.ReplicaDivergence as exc:
            found.append(str(exc).splitlines()[0])
    return found


def check_hf(kind: str, path: str) -> dict:
    """A sharded Hugging Face model is still its class: checkpointing, ``generate``-style calls, exports."""
    from transformers import AutoModelForCausalLM, PreTrainedModel

    model, layer_cls = HF.make_model(kind)
    plain, _ = HF.make_model(kind)
    hs.shard(model, strategy="FULL_SHARD", wrap={layer_cls})
    assert isinstance(model, PreTrainedModel) and isinstance(model, type(plain))
    assert type(model).__name__ == f"HybridShard{type(plain).__name__}"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    assert model.is_gradient_checkpointing
    inputs = HF.batch(0, 0, 2)
    loss = model(**inputs).loss
    loss.backward()
    ref_loss = plain(**inputs).loss
    ref_loss.backward()
    norms = (model.clip_grad_norm_(1e9).item(), _grad_norm(plain))
    hs.checkpoint.save_pretrained(model, f"{path}/ours", config=model.config)
    full = model.full_state_dict()
    if dist.get_rank() == 0:
        model.save_pretrained(f"{path}/hf", state_dict=full, safe_serialization=True)
    dist.barrier()
    model.eval()
    plain.eval()
    with torch.no_grad():
        want = plain(**inputs).logits
        logits = {"sharded": model(**inputs).logits}
        for name in ("ours", "hf"):
            loaded = AutoModelForCausalLM.from_pretrained(f"{path}/{name}").eval()
            logits[name] = loaded(**inputs).logits
    architectures = {name: json.load(open(f"{path}/{name}/config.json")).get("architectures") for name in ("ours", "hf")}
    return {"losses": (loss.item(), ref_loss.item()), "norms": norms, "architectures": architectures,
            "cls": type(plain).__name__,
            "match": {k: torch.allclose(v, want, atol=1e-5) for k, v in logits.items()}}


@pytest.mark.multiprocess
def test_methods_match_the_functions(pool):
    for r in pool.run(check_methods):
        assert r["reduced_in_no_sync"] == 0 and r["gathered_in_no_sync"] > 0, r  # the block held the gradients
        assert r["unclipped"] == pytest.approx(r["ref_norm"], rel=1e-5), r  # both micro-batches, once each
        assert r["again"] == pytest.approx(r["unclipped"], rel=1e-6), r
        assert r["inf"] == pytest.approx(r["ref_inf"], rel=1e-5), r
        assert r["clipped"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["after"] == pytest.approx(0.5 * r["ref_norm"], rel=1e-4), r
        assert r["switch"]["reduced"] == 0 and r["switch"]["norm"] == pytest.approx(r["ref_norm"], rel=1e-5), r
        assert r["steps"] == 1 and r["same"] and r["moved"] and r["shapes"], r


@pytest.mark.multiprocess
def test_check_replicas_method(pool):
    for found in pool.run(check_replicas_method):
        assert found[0] == "ok", found
        assert found[1] != "ok" and "rank" in found[1], found


@pytest.mark.multiprocess
@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_hf_models_keep_their_class(pool, tmp_path, kind):
    for r in pool.run(check_hf, kind, str(tmp_path)):
        assert r["losses"][0] == pytest.approx(r["losses"][1], rel=1e-5), r
        assert r["norms"][0] == pytest.approx(r["norms"][1], rel=1e-4), r
        assert all(r["match"].values()), r
        # transformers' own save_pretrained records the class's name (it strips only FSDP's prefix): docs/api.md
        assert r["architectures"] == {"ours": None, "hf": [f"HybridShard{r['cls']}"]}, r
