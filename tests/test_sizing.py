"""The sizing math (hybridshard.estimates.sizing) and `hybridshard plan --model-params`: formulas, parsing, errors."""

from __future__ import annotations

import json
import math

import pytest

from hybridshard.cli import main
from hybridshard.estimates.sizing import (
    ClusterSpec, LinkClass, ModelSpec, Optimizer, estimate, estimate_all, memory, recommend, shard_sizes, step_collectives,
)
from hybridshard.estimates.format import parse_bytes, parse_count
from hybridshard.runtime.units.strategy import ShardingStrategy as S
from hybridshard.topology.synthetic import synthetic_cluster

INTRA, INTER = LinkClass.INTRA_NODE, LinkClass.INTER_NODE
MODEL = ModelSpec(num_params=1000, unit_params=100, param_dtype="bf16", reduce_dtype="fp32")
TWO_NODES = ClusterSpec(node_sizes=(4, 4), gpu_memory_bytes=10**6, intra_node_gbps=800.0, inter_node_gbps=80.0)


def test_hybrid_shard_bytes_follow_the_ring_formulas():
    e = estimate(S.HYBRID_SHARD, 4, model=MODEL, cluster=TWO_NODES)
    assert (e.shard_size, e.replicate_size) == (4, 2)
    # intra (S-1)/S * P * (2 b_param + b_grad); inter 2 (R-1)/R * P * b_grad / S
    assert e.bytes_by_link[INTRA] == pytest.approx(3 / 4 * 1000 * (2 * 2 + 4))
    assert e.bytes_by_link[INTER] == pytest.approx(2 * 1 / 2 * 1000 * 4 / 4)
    assert e.collectives == pytest.approx({
        ("all_gather", "shard"): 3 / 4 * 2000 * 2, ("reduce_scatter", "shard"): 3 / 4 * 1000 * 4,
        ("all_reduce", "replicate"): 1000.0,
    })
    # seconds = bytes * 8 / (Gb/s * 1e9), the two links one after the other
    assert e.seconds_by_link[INTRA] == pytest.approx(6000 * 8 / 800e9)
    assert e.comm_seconds == pytest.approx(6000 * 8 / 800e9 + 1000 * 8 / 80e9)


def test_root_unit_is_gathered_once_and_zero2_gathers_once():
    rooted = ModelSpec(num_params=1000, unit_params=100, root_params=200, param_dtype="fp32")
    zero3 = step_collectives(S.HYBRID_SHARD, 4, 2, model=rooted)
    zero2 = step_collectives(S.HYBRID_SHARD_ZERO2, 4, 2, model=rooted)
    assert zero3[("all_gather", "shard")] == pytest.approx(3 / 4 * (2 * 1000 - 200) * 4)
    assert zero2[("all_gather", "shard")] == pytest.approx(3 / 4 * 1000 * 4)
    assert zero2[("reduce_scatter", "shard")] == zero3[("reduce_scatter", "shard")]


def test_full_shard_across_nodes_runs_on_the_inter_node_link():
    across = estimate(S.FULL_SHARD, 8, model=MODEL, cluster=TWO_NODES)
    assert across.shard_size == 8 and across.bytes_by_link[INTRA] == 0
    assert across.bytes_by_link[INTER] == pytest.approx(7 / 8 * (2000 * 2 + 1000 * 4))
    assert any("spans 2 nodes" in n for n in across.notes)
    one_node = ClusterSpec(node_sizes=(8,), gpu_memory_bytes=10**6)
    inside = estimate(S.FULL_SHARD, 8, model=MODEL, cluster=one_node)
    assert inside.bytes_by_link[INTER] == 0 and inside.bytes_by_link[INTRA] == across.bytes_by_link[INTER]


def test_no_shard_all_reduces_everything_over_the_world():
    e = estimate(S.NO_SHARD, 1, model=MODEL, cluster=TWO_NODES)
    assert (e.shard_size, e.replicate_size) == (1, 8)
    assert e.collectives == pytest.approx({("all_reduce", "world"): 2 * 7 / 8 * 1000 * 4})


def test_memory_terms():
    m = memory(S.HYBRID_SHARD, 3, model=MODEL)  # 1000 / 3 -> 334 elements per rank (the last shard padded)
    assert (m.params, m.grads, m.optimizer) == (334 * 4, 334 * 4, 2 * 334 * 4)
    # Two units gathered (prefetch 1), less the fp32 gradient shards they do not have yet (34
    # elements each); the unit gradient being built (its parameters' gradients and their
    # concatenation, bf16), its fp32 copy, and the previous unit's fp32 gradient in an overlapped
    # reduce-scatter.
    grad_in_flight = 100 * 2 * 2 + 100 * 4 + 100 * 4
    assert m.gathered == 2 * (100 * 2 - 34 * 4) + grad_in_flight
    assert memory(S.HYBRID_SHARD, 3, model=MODEL, prefetch=0, overlap_grads=False).gathered == \
        100 * 2 - 34 * 4 + 400 + 400
    zero2 = memory(S.HYBRID_SHARD_ZERO2, 3, model=MODEL)
    assert zero2.gathered == 1000 * 2 - 334 * 4 + grad_in_flight  # every unit gathered, no gradient shard yet
    fp32 = ModelSpec(num_params=1000, unit_params=100, param_dtype="fp32", optimizer=Optimizer.SGD)
    replicated = memory(S.NO_SHARD, 1, model=fp32)
    assert replicated.gathered == 100 * 4 * 2  # the master is the compute buffer; only the unit's gradient
    assert replicated.optimizer == 1000 * 4 and replicated.total == 4000 * 3 + 800


def test_a_large_root_peaks_in_its_own_backward():
    """ZeRO-3 with a root (embedding and head) of 600 of 1000 parameters: at the end of backward the
    root's gathered parameters (bf16), its concatenated gradient and that gradient's fp32 copy (the
    parameters' own gradients are freed by then; without a cast, those and the concatenation), and
    the last unit's fp32 gradient in flight outweigh two gathered units; the total takes that peak.
    Found on the 405B-shaped rank, whose untied 128k-vocabulary root is larger than a layer."""
    big_root = ModelSpec(num_params=1000, unit_params=100, root_params=600, optimizer=Optimizer.SGD)
    m = memory(S.HYBRID_SHARD, 4, model=big_root)
    assert m.root_backward == 600 * 2 + 600 * 2 + 600 * 4 + 100 * 4
    same = ModelSpec(num_params=1000, unit_params=100, root_params=600, param_dtype="fp32", reduce_dtype="fp32")
    assert memory(S.HYBRID_SHARD, 4, model=same).root_backward == 600 * 4 * 3 + 100 * 4
    assert m.root_backward > m.gathered and m.total == m.params + m.grads + m.optimizer + m.root_backward
    assert memory(S.HYBRID_SHARD, 4, model=MODEL).root_backward <= memory(S.HYBRID_SHARD, 4, model=MODEL).gathered


def test_adamw_step_temporary_is_the_peak_when_backward_needs_less():
    """Found on an H100: every strategy's one-rank peak was the foreach AdamW step's square root of
    the second moment, one temporary the size of the master shard, which the total left out."""
    fp32 = ModelSpec(num_params=1000, unit_params=100, param_dtype="fp32")  # AdamW
    m = memory(S.NO_SHARD, 1, model=fp32)
    assert m.gathered == 800 and m.step_temp == 1000 * 4
    assert m.total == 1000 * 4 + 1000 * 4 + 2 * 1000 * 4 + 1000 * 4  # the step's peak, not the backward's
    assert memory(S.NO_SHARD, 1, model=fp32, foreach=False).total == 4000 * 4 + 800  # CPU: one parameter at a time
    sliced = memory(S.HYBRID_SHARD, 2, model=fp32, replicate_size=4, shard_optimizer=True)
    assert sliced.step_temp == 125 * 4  # the optimizer's slice of the shard
    sgd = memory(S.NO_SHARD, 1, model=ModelSpec(num_params=1000, unit_params=100, param_dtype="fp32",
                                                optimizer=Optimizer.SGD))
    assert sgd.step_temp == 0


def test_shard_sizes_tile_every_node():
    assert shard_sizes(TWO_NODES) == [2, 4]
    assert shard_sizes(ClusterSpec(node_sizes=(8, 4), gpu_memory_bytes=1)) == [2, 4]
    assert shard_sizes(ClusterSpec(node_sizes=(3, 2), gpu_memory_bytes=1)) == []
    options = estimate_all(model=MODEL, cluster=TWO_NODES)
    assert [(e.label, e.shard_size) for e in options] == [
        ("FULL_SHARD", 8), ("SHARD_GRAD_OP", 8), ("NO_SHARD", 1),
        ("HYBRID_SHARD", 2), ("HYBRID_SHARD", 4), ("HYBRID_SHARD_ZERO2", 2), ("HYBRID_SHARD_ZERO2", 4),
        ("HYBRID_SHARD+optim", 2), ("HYBRID_SHARD+optim", 4),
    ]


def test_recommendation_fits_and_is_fastest():
    options = estimate_all(model=MODEL, cluster=TWO_NODES)
    rec = recommend(options, cluster=TWO_NODES)
    fitting = [e for e in options if e.fits]
    assert rec.choice in fitting
    assert rec.choice.comm_seconds <= min(e.comm_seconds for e in fitting) * 1.01
    tiny = ClusterSpec(node_sizes=(4, 4), gpu_memory_bytes=100)
    nothing = recommend(estimate_all(model=MODEL, cluster=tiny), cluster=tiny)
    assert nothing.choice is None and "nothing fits" in nothing.reason and "FULL_SHARD" in nothing.reason


@pytest.mark.parametrize("kwargs, needle", [
    (dict(num_params=0, unit_params=1), "num_params must be a positive integer"),
    (dict(num_params=10, unit_params=11), "unit_params must be between 1 and num_params (10)"),
    (dict(num_params=10, unit_params=1, root_params=-1), "root_params must be between 0"),
    (dict(num_params=10, unit_params=1, param_dtype="int8"), "param_dtype must be one of fp32, bf16, fp16"),
    (dict(num_params=10, unit_params=1, optimizer="adamw"), "must be a hybridshard.estimates.sizing.Optimizer"),
])
def test_model_spec_rejects_bad_values(kwargs, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec(**kwargs)


def test_cluster_spec_rejects_bad_values():
    with pytest.raises(ValueError, match="node_sizes"):
        ClusterSpec(node_sizes=(), gpu_memory_bytes=1)
    with pytest.raises(ValueError, match="inter_node_gbps must be a positive number"):
        ClusterSpec(node_sizes=(8,), gpu_memory_bytes=1, inter_node_gbps=0)


def test_parse_quantities():
    assert parse_count("7e9") == parse_count("7B") == parse_count("7 b") == 7_000_000_000
    assert parse_count("350M") == 350_000_000 and parse_count("1.3b") == 1_300_000_000
    assert parse_count("0", minimum=0) == 0
    assert parse_bytes("80GB") == parse_bytes("80") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30 and parse_bytes("141 gb") == 141 * 10**9
    for bad in ("-1", "0", "abc", "1e400", "7 parsecs"):
        with pytest.raises(ValueError, match="expected a positive parameter count"):
            parse_count(bad)
    for bad in ("lots", "80 GBs", "-5GB", "0GB"):
        with pytest.raises(ValueError, match="expected a positive size such as 80GB"):
            parse_bytes(bad)


def test_cli_text_lists_every_option_and_recommends(capsys):
    assert main(["plan", "--model-params", "7e9", "--nodes", "2", "--gpus-per-node", "8"]) == 0
    out = capsys.readouterr().out
    rows = [line.split() for line in out.splitlines() if line.split()[:1] and line.split()[0] in S.__members__]
    assert [(r[0], r[1]) for r in rows] == [
        ("FULL_SHARD", "16"), ("SHARD_GRAD_OP", "16"), ("NO_SHARD", "1"),
        ("HYBRID_SHARD", "2"), ("HYBRID_SHARD", "4"), ("HYBRID_SHARD", "8"),
        ("HYBRID_SHARD_ZERO2", "2"), ("HYBRID_SHARD_ZERO2", "4"), ("HYBRID_SHARD_ZERO2", "8"),
    ]
    fits = {(r[0], r[1]): r[9] for r in rows}  # name, S, "x", R, 4 memory terms, total, fits
    assert fits[("NO_SHARD", "1")] == "NO" and fits[("HYBRID_SHARD", "8")] == "yes"  # 7B x 16 B/param > 80 GB
    assert "recommended: HYBRID_SHARD" in out and "spans 2 nodes" in out


def test_cli_json_matches_the_math(capsys):
    argv = ["plan", "--model-params", "1.3B", "--nodes", "4", "--gpus-per-node", "4", "--layers", "24",
            "--gpu-memory", "24GB", "--inter-node-gbps", "100", "--optimizer", "sgd", "--json"]
    assert main(argv) == 0
    data = json.loads(capsys.readouterr().out)
    model = ModelSpec(num_params=1_300_000_000, unit_params=-(-1_300_000_000 // 24), optimizer=Optimizer.SGD)
    cluster = ClusterSpec(node_sizes=(4, 4, 4, 4), gpu_memory_bytes=24 * 10**9, inter_node_gbps=100.0)
    expected = estimate_all(model=model, cluster=cluster)
    assert [(o["strategy"], o["shard_size"]) for o in data["options"]] == [(e.strategy.name, e.shard_size) for e in expected]
    for got, want in zip(data["options"], expected):
        assert got["memory_bytes"]["total"] == want.memory.total and got["fits"] == want.fits
        assert math.isclose(got["comm_seconds"], want.comm_seconds)
    rec = recommend(expected, cluster=cluster).choice
    assert data["recommended"] == {"strategy": rec.strategy.name, "shard_size": rec.shard_size,
                                   "replicate_size": rec.replicate_size,
                                   "shard_optimizer_across_replicas": rec.shard_optimizer}


def test_cli_gpu_memory_from_a_saved_cluster(tmp_path, capsys):
    view = synthetic_cluster(2, 4).to_dict()
    for node in view["nodes"]:
        for gpu in node["probe"]["gpus"]:
            gpu["memory_total_bytes"] = 24 * 10**9
    path = tmp_path / "cluster.json"
    path.write_text(json.dumps({"cluster": view}))
    assert main(["plan", "--from", str(path), "--model-params", "1B", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["cluster"]["gpu_memory_bytes"] == 24 * 10**9 and data["cluster"]["node_sizes"] == [4, 4]


@pytest.mark.parametrize("extra, needle", [
    (["--model-params", "-1"], "--model-params: expected a positive parameter count"),
    (["--model-params", "7e9", "--gpu-memory", "lots"], "--gpu-memory: expected a positive size"),
    (["--model-params", "7e9", "--layers", "0"], "--layers: expected a positive number of layers"),
    (["--model-params", "7e9", "--unit-params", "8e9"], "unit_params must be between 1 and num_params"),
    (["--model-params", "7e9", "--inter-node-gbps", "0"], "inter_node_gbps must be a positive number"),
    (["--model-params", "7e9", "--domain", "nvlink"], "sizes shard groups inside nodes"),
    (["--model-params", "7e9", "--shard-size", "3"], "--shard-size 3 does not tile the nodes; pick one of [2, 4, 8]"),
])
def test_cli_errors_exit_2_with_the_reason(capsys, extra, needle):
    assert main(["plan", "--nodes", "2", "--gpus-per-node", "8", *extra]) == 2
    captured = capsys.readouterr()
    assert needle in captured.err and captured.out == ""


def test_cli_shard_size_restricts_the_hybrid_rows(capsys):
    assert main(["plan", "--model-params", "7e9", "--shard-size", "4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {o["shard_size"] for o in data["options"] if o["strategy"].startswith("HYBRID")} == {4}


def test_optimizer_sharded_across_replicas():
    """HYBRID_SHARD+optim: the replicate all-reduce split into a reduce-scatter and an all-gather (same
    bytes with an fp32 reduce); gradients and optimizer state divided by R; the master shard is not."""
    fp32 = ModelSpec(num_params=8_000_000, unit_params=1_000_000, param_dtype="fp32", reduce_dtype="fp32",
                     master_dtype="fp32")
    plain = step_collectives(S.HYBRID_SHARD, 4, 2, model=fp32)
    sliced = step_collectives(S.HYBRID_SHARD, 4, 2, model=fp32, shard_optimizer=True)
    assert sliced[("reduce_scatter", "replicate")] == sliced[("all_gather", "replicate")] == 0.5 * 2_000_000 * 4
    assert ("all_reduce", "replicate") not in sliced
    assert sliced[("reduce_scatter", "replicate")] * 2 == plain[("all_reduce", "replicate")]
    cluster = ClusterSpec(node_sizes=(4, 4), gpu_memory_bytes=10**12)
    a = estimate(S.HYBRID_SHARD, 4, model=fp32, cluster=cluster)
    b = estimate(S.HYBRID_SHARD, 4, model=fp32, cluster=cluster, shard_optimizer=True)
    assert (b.memory.optimizer * 2, b.memory.grads * 2, b.memory.params) == (a.memory.optimizer, a.memory.grads,
                                                                             a.memory.params)
    assert b.bytes_by_link == a.bytes_by_link
    assert recommend([a, b], cluster=cluster).choice is b  # same traffic, less memory
    # bf16 compute: the all-gather sends bf16; the master is an fp32 slice plus a bf16 shard.
    bf16 = ModelSpec(num_params=8_000_000, unit_params=1_000_000, param_dtype="bf16", reduce_dtype="fp32")
    low = step_collectives(S.HYBRID_SHARD, 4, 2, model=bf16, shard_optimizer=True)
    assert low[("all_gather", "replicate")] * 2 == low[("reduce_scatter", "replicate")]
    c = estimate(S.HYBRID_SHARD, 4, model=bf16, cluster=cluster, shard_optimizer=True)
    assert c.memory.params == 1_000_000 * 4 + 2_000_000 * 2
    with pytest.raises(ValueError, match="shard_optimizer expects a hybrid strategy, found FULL_SHARD"):
        estimate(S.FULL_SHARD, 8, model=fp32, cluster=cluster, shard_optimizer=True)
