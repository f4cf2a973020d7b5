"""``shard(..., compile=...)``: compiled units match eager ones, with no graph break and no recompile.

One 2-rank pool (gloo, 2 simulated nodes of one rank; FULL_SHARD shards over both ranks) runs each
case eager and compiled (``aot_eager``, see tests/compile_jobs.py) for 3 SGD steps: the tiny bench
GPT (2 blocks); the same with non-reentrant activation checkpointing around each block plus
``no_sync`` over two micro-batches; HYBRID_SHARD across the two nodes (shard groups of 1, so the
gradient path is the replicate all-reduce); variable sequence lengths; Hugging Face's tiny Llama.
Counted with torch's own counters: ``counters["frames"]["ok"]`` (the blocks share their code: one
frame) and ``counters["graph_break"]``; ``torch._dynamo.config.error_on_recompile`` is on after step 1.

The rest of the matrix (the other strategies, bf16 mixed precision, the optimizer sharded across
replicas, GPT-2) runs with ``HYBRIDSHARD_COMPILE_MATRIX=1``; CI leaves it out to keep its compile
time down.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.compile_jobs import compiled_and_eager
from tests.mp import RankPool

TOL = 1e-5


@pytest.fixture(scope="module")
def pool():
    # Inductor may hold a rank in one frame while it compiles (a C++ build under load): a wider stall window.
    with RankPool(2, num_nodes=2, stall_s=180) as p:
        yield p


def _check(result: dict, *, steps: int = 3, recompiles: int = 0) -> None:
    assert result["breaks"] == 0, result["break_reasons"]
    assert result["eager_frames"] == 0
    # 2 blocks of one class: one frame, compiled in the first step and never again (else the
    # error_on_recompile switch would have raised in the rank).
    assert result["first_frames"] == 1 and result["frames"] == 1 + recompiles
    for key in ("losses", "norms"):
        eager, compiled = result[f"eager_{key}"], result[f"compiled_{key}"]
        assert len(eager) == len(compiled) == steps
        assert max(abs(a - b) for a, b in zip(eager, compiled)) <= TOL, (key, eager, compiled)
    assert result["param_max_diff"] <= TOL
    # SGD with lr 0.5 and no clip: the parameters moved, so a constant-factor gradient error would show.
    assert result["eager_losses"][-1] < result["eager_losses"][0]


def test_compiled_full_shard_matches_eager(pool):
    for result in pool.run(compiled_and_eager):
        _check(result)


def test_compiled_with_checkpointing_and_no_sync(pool):
    for result in pool.run(compiled_and_eager, checkpoint=True, accumulate=True):
        _check(result)


def test_compiled_hybrid_shard_across_nodes(pool):
    for result in pool.run(compiled_and_eager, strategy="HYBRID_SHARD", hybrid=True):
        assert result["groups"] == (1, 2)  # shard x replicate
        _check(result)


def test_compiled_variable_sequence_lengths(pool):
    """Lengths 8, 6, 4, 7: one recompile (dynamo makes the length dynamic in step 2), none after it."""
    for result in pool.run(compiled_and_eager, seqs=(8, 6, 4, 7)):
        _check(result, steps=4, recompiles=1)


MATRIX = {
    "SHARD_GRAD_OP": dict(strategy="SHARD_GRAD_OP"),
    "NO_SHARD": dict(strategy="NO_SHARD"),
    "gpt2": dict(hf="gpt2"),
    "HYBRID_SHARD_ZERO2": dict(strategy="HYBRID_SHARD_ZERO2", hybrid=True),
    "bf16": dict(shard_options={"mixed_precision": "bf16"}),
    "optimizer_across_replicas": dict(strategy="HYBRID_SHARD", hybrid=True,
                                      shard_options={"shard_optimizer_across_replicas": True}),
}


@pytest.mark.skipif(os.environ.get("HYBRIDSHARD_COMPILE_MATRIX") != "1", reason="set HYBRIDSHARD_COMPILE_MATRIX=1")
@pytest.mark.parametrize("case", sorted(MATRIX))
def test_compile_matrix(pool, case):
    kw = dict(MATRIX[case])
    if kw.get("shard_options", {}).get("mixed_precision") == "bf16":
        import hybridshard as hs

        kw["shard_options"] = {"mixed_precision": hs.MixedPrecision(param_dtype=torch.bfloat16,
                                                                     reduce_dtype=torch.float32)}
    for result in pool.run(compiled_and_eager, **kw):
        _check(result)


def test_compile_option_errors():
    from hybridshard.runtime.setup.compile import parse_compile

    assert parse_compile(False) is None and parse_compile(None) is None
    assert parse_compile(True) == {}
    assert parse_compile({"mode": "reduce-overhead"}) == {"mode": "reduce-overhead"}
    with pytest.raises(ValueError, match="compile must be True, False or a dict"):
        parse_compile("yes")
    with pytest.raises(ValueError, match=r"torch.compile accepts the keywords .* found \['modes'\]"):
        parse_compile({"modes": "x"})


def test_compiled_hf_llama(pool):
    """Hugging Face's Llama (keyword inputs, dataclass output, SDPA, ``use_cache=False``): its decoder
    layers compiled."""
    for result in pool.run(compiled_and_eager, hf="llama"):
        _check(result)
