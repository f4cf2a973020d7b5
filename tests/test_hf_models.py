"""Hugging Face GPT-2 and Llama, built from configs, under every strategy and every checkpointing form.

Each run trains 3 AdamW steps with clipping on 4 ranks (2 simulated nodes) and is compared with one
process on the global batch: the loss of every step and every parameter. Then the cyclic rank
order for the hybrid strategies, and a greedy generation loop (``eval()``, ``no_grad``, KV cache).
"""

from __future__ import annotations

import pytest
import torch

from hybridshard.runtime.units.strategy import ShardingStrategy
from tests import hf_models as HF
from tests import runtime_models as RM
from tests.mp import RankPool

pytestmark = pytest.mark.multiprocess

WORLD = 4
STRATEGIES = [s.name for s in ShardingStrategy]
TOL = dict(atol=1e-5, rtol=1e-5)

BLOCK = [HF.HFConfig(model=m, strategy=s, checkpoint=c) for m in ("gpt2", "llama") for s in STRATEGIES for c in HF.CHECKPOINTS]
CYCLIC = [HF.HFConfig(model=m, strategy=s, checkpoint=c)
          for m in ("gpt2", "llama") for s in ("HYBRID_SHARD", "HYBRID_SHARD_ZERO2") for c in ("none", "hf")]
PROMPT = torch.tensor([[5, 9, 13, 17], [20, 3, 33, 8]])
NEW_TOKENS = 4


def _ids(configs):
    return [f"{c.model}-{c.strategy}-{c.checkpoint}" for c in configs]


@pytest.fixture(scope="module")
def block_results():
    with RankPool(WORLD, num_nodes=2, layout="block") as pool:
        trained = pool.run(HF.run_configs, BLOCK)
        generated = {
            (kind, s): pool.run(HF.generate, kind, s, PROMPT, NEW_TOKENS)
            for kind in ("gpt2", "llama") for s in STRATEGIES
        }
    return trained, generated


@pytest.fixture(scope="module")
def cyclic_results():
    with RankPool(WORLD, num_nodes=2, layout="cyclic") as pool:
        return pool.run(HF.run_configs, CYCLIC)


_REFERENCES: dict = {}


def _reference(cfg: HF.HFConfig):
    key = (cfg.model, cfg.steps, cfg.micro_batch, cfg.lr)
    if key not in _REFERENCES:
        with RM.single_thread():
            _REFERENCES[key] = HF.reference_run(cfg, WORLD)
    return _REFERENCES[key]


def _compare(ref, got, label):
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(ref["losses"]), **TOL,
                               msg=lambda m: f"{label} losses: {m}")
    assert set(got["state"]) == set(ref["state"]), f"{label}: keys differ: {set(got['state']) ^ set(ref['state'])}"
    for key, value in ref["state"].items():
        torch.testing.assert_close(got["state"][key], value, **TOL, msg=lambda m: f"{label} {key}: {m}")


@pytest.mark.parametrize("index", range(len(BLOCK)), ids=_ids(BLOCK))
def test_hf_parity_block(block_results, index):
    cfg = BLOCK[index]
    ref = _reference(cfg)
    assert ref["losses"][-1] < ref["losses"][0], "the reference does not learn: the comparison would be weak"
    for rank, results in enumerate(block_results[0]):
        _compare(ref, results[index], f"{cfg} rank {rank}")


@pytest.mark.parametrize("index", range(len(CYCLIC)), ids=_ids(CYCLIC))
def test_hf_parity_cyclic(cyclic_results, index):
    cfg = CYCLIC[index]
    for rank, results in enumerate(cyclic_results):
        _compare(_reference(cfg), results[index], f"cyclic {cfg} rank {rank}")


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_generate_in_eval_no_grad(block_results, kind, strategy):
    with RM.single_thread():
        ref = HF.generate(kind, None, PROMPT, NEW_TOKENS)
    assert ref["tokens"].shape == (2, PROMPT.shape[1] + NEW_TOKENS)
    for rank, got in enumerate(block_results[1][(kind, strategy)]):
        assert torch.equal(got["tokens"], ref["tokens"]), f"rank {rank}: {got['tokens']} != {ref['tokens']}"
        torch.testing.assert_close(got["logits"], ref["logits"], **TOL)
