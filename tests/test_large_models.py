"""Models bigger than one process: meta init, pretrained loads, exports, and state dicts that refuse.

Tiny GPT-2 (tied head) and Llama (grouped-query attention, rotary buffers) saved by transformers
(GPT-2 as one ``model.safetensors``, Llama as three shards and an index), on 4 ranks over 2
simulated nodes in block and cyclic order (tests/mp.py), compared with one plain process:
``hs.materialize`` for init, ``from_pretrained`` for loads and exports. ``pytest -s`` prints the
measured bytes.
"""

from __future__ import annotations

import os

import pytest
import torch

import hybridshard as hs
from hybridshard.runtime.units.strategy import ShardingStrategy
from tests import hf_models as HF
from tests import large_jobs as J
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
KINDS = ("gpt2", "llama")
STRATEGIES = [s.name for s in ShardingStrategy]
LOADS = [(k, s) for k in KINDS for s in STRATEGIES]
CYCLIC = [(k, s) for k in KINDS for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2")]
INITS = [(k, s) for k in KINDS for s in ("HYBRID_SHARD", "FULL_SHARD", "NO_SHARD")]
MEMORY = ("FULL_SHARD", "HYBRID_SHARD", "NO_SHARD")


def _seeded_reference(kind: str, seed: int) -> torch.nn.Module:
    """The documented init rule, written out on a model built for real: every module, children before
    parents (``nn.Module.apply``'s order), is initialised by ``_init_weights`` right after the generator
    is seeded with ``(seed * 1_000_003 + crc32(name)) % 2**63``, ``name`` its qualified name."""
    import zlib

    model, _ = HF.make_model(kind)
    names = {id(m): n for n, m in model.named_modules()}

    def init(module: torch.nn.Module) -> None:
        torch.manual_seed((seed * 1_000_003 + zlib.crc32(names[id(module)].encode())) % (1 << 63))
        model._init_weights(module)

    with torch.no_grad():
        model.apply(init)
    return model


def _from_pretrained(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    paths = {}
    for kind in KINDS:
        model, _ = HF.make_model(kind, seed=3)
        paths[kind] = str(root / kind)
        # Llama in several files with an index, GPT-2 in one.
        model.save_pretrained(paths[kind], max_shard_size="10KB" if kind == "llama" else "1GB")
    assert os.path.exists(os.path.join(paths["llama"], "model.safetensors.index.json"))
    assert os.path.exists(os.path.join(paths["gpt2"], "model.safetensors"))
    return {"paths": paths, "out": str(root / "export"), "empty": str(tmp_path_factory.mktemp("empty"))}


@pytest.fixture(scope="module")
def block(checkpoints):
    paths = checkpoints["paths"]
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        return {
            "init": pool.run(J.init_states, INITS),
            "load": pool.run(J.load_logits, LOADS, paths),
            "export": {k: pool.run(J.export, k, "HYBRID_SHARD", paths[k], f"{checkpoints['out']}-{k}") for k in KINDS},
            "memory": {s: pool.run(J.memory, "llama", s, paths["llama"]) for s in MEMORY},
            "refusals": pool.run(J.refusals),
            "bad": pool.run(J.bad_inputs, checkpoints["empty"], paths),
            "optimizer": pool.run(J.optimizer_before_shard, 3),
        }


@pytest.fixture(scope="module")
def cyclic(checkpoints):
    with RankPool(WORLD, num_nodes=2, layout="cyclic") as pool:
        return pool.run(J.load_logits, CYCLIC, checkpoints["paths"])


def _reference_logits(path: str) -> torch.Tensor:
    with RM.single_thread(), torch.no_grad():
        return _from_pretrained(path)(**HF.batch(7, 0, 2)).logits


@pytest.mark.parametrize("index", range(len(INITS)), ids=[f"{k}-{s}" for k, s in INITS])
def test_meta_init_is_the_same_model_on_any_topology(block, index):
    kind, strategy = INITS[index]
    with torch.device("meta"):
        plain, _ = HF.make_model(kind)
    hs.materialize(plain, param_init_fn=plain._init_weights, init_seed=J.SEED)
    ref = {k: v for k, v in _seeded_reference(kind, J.SEED).state_dict().items()}
    other = _seeded_reference(kind, J.SEED + 1).state_dict()
    buffers = dict(plain.named_buffers())
    real, _ = HF.make_model(kind)
    for name, value in real.named_buffers():  # rotary frequencies: what a model built for real holds
        assert torch.equal(buffers[name], value), name
    # materialize and every rank's shards against the rule written out, every entry.
    assert set(plain.state_dict()) == set(ref)
    for key, value in plain.state_dict().items():
        assert torch.equal(value, ref[key]), f"{kind} materialize: {key}"
    for rank, got in enumerate(block["init"]):
        state = got[index]
        assert set(state) == set(ref)
        for key, value in ref.items():
            assert torch.equal(state[key], value), f"{kind} {strategy} rank {rank}: {key}"
    # The seed reaches every random entry: another seed changes each one that is not a constant fill.
    for key, value in ref.items():
        if value.numel() > 1 and value.unique().numel() > 1:
            assert not torch.equal(value, other[key]), key


@pytest.mark.parametrize("index", range(len(LOADS)), ids=[f"{k}-{s}" for k, s in LOADS])
def test_load_pretrained_gives_from_pretrained_logits_block(block, checkpoints, index):
    kind, strategy = LOADS[index]
    ref = _reference_logits(checkpoints["paths"][kind])
    for rank, got in enumerate(block["load"]):
        torch.testing.assert_close(got[index]["logits"], ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"{kind} {strategy} rank {rank}: {m}")


@pytest.mark.parametrize("index", range(len(CYCLIC)), ids=[f"{k}-{s}" for k, s in CYCLIC])
def test_load_pretrained_gives_from_pretrained_logits_cyclic(cyclic, checkpoints, index):
    kind, strategy = CYCLIC[index]
    ref = _reference_logits(checkpoints["paths"][kind])
    for rank, got in enumerate(cyclic):
        torch.testing.assert_close(got[index]["logits"], ref, atol=1e-5, rtol=1e-5,
                                   msg=lambda m: f"cyclic {kind} {strategy} rank {rank}: {m}")


@pytest.mark.parametrize("index", range(len(LOADS)), ids=[f"{k}-{s}" for k, s in LOADS])
def test_striped_reads_serve_each_byte_once_per_job(block, index):
    kind, strategy = LOADS[index]
    results = [got[index] for got in block["load"]]
    total = sum(r["result"].bytes_read for r in results)
    for rank, r in enumerate(results):
        res, replicate = r["result"], r["replicate"]
        print(f"{kind} {strategy} rank {rank}: read {res.bytes_read} B, {res.bytes_unstriped} B without striping, "
              f"{res.bytes_model} B in the model (replicate size {replicate})")
        assert res.bytes_read <= res.bytes_unstriped / replicate + r["unit_bytes"]
        if replicate > 1:
            assert res.bytes_read < res.bytes_unstriped
    model_bytes = results[0]["result"].bytes_model
    # The job reads the model about once (whole rows at stripe edges, buffers on every rank), not R times.
    assert total <= 1.5 * model_bytes, (total, model_bytes)


@pytest.mark.parametrize("kind", KINDS)
def test_export_round_trip_is_exact(block, checkpoints, kind):
    out = f"{checkpoints['out']}-{kind}"
    assert os.path.exists(os.path.join(out, "model.safetensors.index.json"))
    assert not os.path.exists(out + ".partial")
    back = _from_pretrained(out)
    state = back.state_dict()
    for rank, full in enumerate(block["export"][kind]):
        for key, value in full.items():
            assert torch.equal(state[key], value), f"{kind} rank {rank}: {key}"
    from safetensors.torch import load_file

    half = {}
    for name in os.listdir(out + "-bf16"):
        if name.endswith(".safetensors"):
            half.update(load_file(os.path.join(out + "-bf16", name)))
    assert half and all(v.dtype == torch.bfloat16 for v in half.values())
    for key, value in half.items():
        assert torch.equal(value, block["export"][kind][0][key].to(torch.bfloat16)), key
    # The export is the trained model, not the loaded one.
    loaded = _from_pretrained(checkpoints["paths"][kind]).state_dict()
    assert any(not torch.equal(loaded[k], v) for k, v in state.items() if v.is_floating_point())


@pytest.mark.parametrize("strategy", MEMORY)
def test_init_and_load_hold_shards_plus_one_unit(block, strategy):
    for rank, m in enumerate(block["memory"][strategy]):
        print(f"llama {strategy} rank {rank}: {m}")
        assert m["init_peak"] >= m["shards"]  # the counter saw the shards being made
        assert m["init_peak"] <= 1.1 * (m["shards"] + m["buffers"] + m["unit"]), (rank, m)
        # The shards exist before the load: it adds less than one unit on top of them.
        assert m["gather_buffers"] == 0 and m["load_peak"] <= 1.1 * m["unit"], (rank, m)


def test_state_dict_refuses_instead_of_lying(block):
    for rank, out in enumerate(block["refusals"]):
        assert out.pop("unchanged") == "True", rank
        for call, line in out.items():
            assert "refused on a sharded LlamaForCausalLM" in line, (rank, call, line)
            assert "hybridshard.full_state_dict" in line and "hybridshard.save_checkpoint" in line, line


def test_bad_inputs_name_the_fix(block):
    for rank, out in enumerate(block["bad"]):
        assert "has no reset_parameters(); pass shard(..., param_init_fn=fn)" in out["no_init"], out
        assert "LlamaRMSNorm" in out["no_init"], out
        assert "no parameter or buffer of LlamaForCausalLM is on the meta device" in out["init_fn_not_meta"], out
        assert "the init seed differs across ranks: rank 0 has 0, rank 1 has 1" in out["seeds_differ"], out
        assert "expected a Hugging Face checkpoint" in out["not_a_checkpoint"], out
        assert "the checkpoint lacks 21 parameter(s) of the model: 'model.embed_tokens.weight'" in out["other_model"], out
        assert "nothing was loaded" in out["other_model"] and out["unchanged"] == "True", out
        assert "this LlamaForCausalLM is not sharded; call hybridshard.shard(model, ...) first" in out["plain"], out


def test_optimizer_built_before_shard_keeps_training(block):
    model, _ = HF.make_model("llama")
    groups = hs.param_groups(model, weight_decay=0.1)
    opt = torch.optim.AdamW(groups, lr=1e-2)
    losses = []
    with RM.single_thread():
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            parts = [HF.batch(step, r, 2) for r in range(WORLD)]
            loss = model(**{k: torch.cat([p[k] for p in parts]) for k in parts[0]}).loss
            loss.backward()
            opt.step()
            losses.append(loss.item())
    decay, plain = (len(g["params"]) for g in groups)
    assert decay and plain and all(p.dim() >= 2 for p in groups[0]["params"])
    for rank, got in enumerate(block["optimizer"]):
        assert got["same_groups"] and got["dims"] == [1] and got["decay"] == [decay, plain], got
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(losses), atol=1e-5, rtol=1e-5)
        for key, value in model.state_dict().items():
            torch.testing.assert_close(got["state"][key], value, atol=1e-5, rtol=1e-5, msg=lambda m: f"{key}: {m}")


def test_model_check_sums_without_a_float64_copy():
    from hybridshard.runtime.setup import model_check
    from tests.live_bytes import LiveTensorBytes

    model = torch.nn.Linear(1024, 256)  # 262,144 elements: a float64 copy would be 2 MiB
    with LiveTensorBytes() as live:
        rows = model_check._digest(model, values=True)
    assert live.peak() <= model_check._CHUNK_NUMEL * 8 + 64, live.peak()  # one float64 chunk (and a scalar)
    weight = model.weight.detach().double()
    assert float.fromhex(rows[0][3]) == pytest.approx(float(weight.sum()), rel=1e-9, abs=1e-9)
    assert float.fromhex(rows[0][4]) == pytest.approx(float(weight.abs().sum()), rel=1e-9)
    with torch.device("meta"):
        meta = torch.nn.Linear(1024, 256)
    assert [r[:3] for r in model_check._digest(meta, values=True)] == [
        ("weight", (256, 1024), "torch.float32 meta"), ("bias", (256,), "torch.float32 meta")]


def test_finetune_llama_example(tmp_path):
    """examples/finetune_llama.py end to end: 2 simulated nodes x 2 ranks, meta init, load, train,
    checkpoint, export, from_pretrained."""
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("RANK", None)
    done = subprocess.run([sys.executable, os.path.join(root, "examples", "finetune_llama.py"),
                           "--workdir", str(tmp_path), "--steps", "4"],
                          capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads([line for line in done.stdout.splitlines() if line.startswith("{")][-1])
    print(report)
    assert report["load_max_logit_diff"] <= 1e-5 and report["export_max_logit_diff"] <= 1e-5, report
    assert report["losses"][-1] < report["losses"][0], report
    assert report["bytes_read_rank0"] < report["bytes_unstriped_rank0"], report
    assert os.path.exists(tmp_path / "ckpt" / "step_00000004" / "hybridshard.json")
    assert os.path.exists(tmp_path / "export" / "config.json")
