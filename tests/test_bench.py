"""`hybridshard bench`: the real command end to end on loopback, and its parts without processes."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import time

import pytest
import torch

from hybridshard.bench import stats
from hybridshard.bench.config import BenchConfig, Contestant, System, contestants, parse_variant, shard_options
from hybridshard.bench.progress import TAG, Progress, ProgressSink
from hybridshard.bench.report import render_text
from hybridshard.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--d-model", "32", "--layers", "2", "--heads", "2", "--seq", "16", "--batch", "4",
        "--warmup", "1", "--rounds", "2", "--steps", "1"]


@pytest.mark.multiprocess
@pytest.mark.timeout(240)
def test_bench_end_to_end_on_loopback(tmp_path):
    """2 agents as 2 nodes x 2 ranks, every system, a tiny model: JSON on stdout and on disk, and a PNG."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env["PYTHONPATH"] = os.pathsep.join([REPO, *filter(None, [env.get("PYTHONPATH")])])
    out = tmp_path / "results"
    done = subprocess.run([sys.executable, "-m", "hybridshard", "bench", *TINY, "--out", str(out), "--json"],
                          env=env, cwd=tmp_path, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(done.stdout)
    assert json.loads((out / "bench.json").read_text()) == results
    assert (out / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert TAG not in done.stderr and "12/12" in done.stderr  # progress lines became the bar
    assert results["world_size"] == 4 and results["shard_size"] == 2 and results["replicate_size"] == 2
    assert results["shard_groups"] == [[0, 1], [2, 3]] and results["link"].startswith("loopback")
    systems = results["systems"]
    assert list(systems) == ["hybridshard", "fsdp1", "fsdp2", "floor"]
    medians = {n: e["median_ms"] for n, e in systems.items()}
    for name, e in systems.items():
        assert 0 < e["p10_ms"] <= e["median_ms"] <= e["p90_ms"] and len(e["times_ms"]) == 2
        assert set(e["ratio"]) == {"fsdp1", "fsdp2", "floor"}
        for base, ratio in e["ratio"].items():
            assert ratio == pytest.approx(medians[name] / medians[base])
        assert e["loss_max_abs_diff"] is not None and e["loss_max_abs_diff"] < 1e-5, (name, e["losses"])
        assert e["peak_bytes"] >= e["state_bytes"] > 0
        if name != "floor":
            for group in ("shard", "replicate"):
                assert e["bytes_per_step"][group]["total"]["ring_bytes"] > 0, (name, group)
    hooks = systems["hybridshard"]["hook_ms_per_step_by_rank"]
    assert len(hooks) == 4 and all(set(h) == {"<root>", "blocks.0", "blocks.1"} for h in hooks), hooks
    assert all(ms > 0 for h in hooks for ms in h.values())
    assert systems["fsdp1"]["hook_ms_per_step_by_rank"] == [None] * 4
    for name in ("hybridshard", "fsdp1", "fsdp2"):  # one clock for every system's hooks
        assert all(ms > 0 for ms in systems[name]["hooks_ms_per_step_by_rank"]), (name, systems[name])
        # CPU time inside the hooks: their own work, never more than the wall time they took (hybridshard's
        # also counts its communication thread's jobs, which run beside the hooks)
        cpu = systems[name]["hooks_cpu_ms_per_step_by_rank"]
        assert all(ms > 0 for ms in cpu), (name, cpu)
        if name != "hybridshard":
            assert all(c <= w * 1.05 for c, w in zip(cpu, systems[name]["hooks_ms_per_step_by_rank"])), (name, cpu)
    assert systems["floor"]["hooks_ms_per_step_by_rank"] == [None] * 4
    assert systems["floor"]["hooks_cpu_ms_per_step_by_rank"] == [None] * 4
    assert systems["floor"]["bytes_per_step"] == {} and systems["floor"]["loss_compared_steps"] == 1
    assert systems["fsdp1"]["loss_compared_steps"] == 2  # warm-up + the first round
    assert results["reference"] == "hybridshard"
    text = render_text(results)
    assert "hybridshard" in text and "fsdp2" in text and "loss diff" in text


def test_cli_errors_before_any_rank_starts(capsys, monkeypatch):
    cases = (
        (["--variants", "hybridshard:no_such_option=1"], "does not accept ['no_such_option']"),
        (["--variants", "fsdp1"], "must start with 'hybridshard'"),
        (["--systems", "hybridshard,ddp"], "unknown system 'ddp'"),
        (["--batch", "6"], "--batch 6 must divide by the number of ranks 4"),
        (["--steps", "0"], "steps must be >= 1"),
        (["--d-model", "30", "--heads", "4"], "--d-model 30 must divide by --heads 4"),
        (["--systems", "fsdp1,fsdp1"], "same contestant twice"),
        (["--inter-node-bandwidth", "fast"], "is not a tc rate"),
    )
    for argv, fragment in cases:
        assert main(["bench", *argv]) == 2, argv
        assert fragment in capsys.readouterr().err, argv
    monkeypatch.setattr("hybridshard.bench.job.check_rights", lambda: "`ip netns add` failed: Operation not permitted")
    assert main(["bench", "--inter-node-bandwidth", "1gbit"]) == 2
    err = capsys.readouterr().err
    assert "needs the rights to create network namespaces (root" in err and "Operation not permitted" in err


def test_variants_pass_shard_options_and_reject_unknown_ones():
    v = parse_variant("hybridshard:prefetch=0,overlap_grads=false,replicate_compression=none,x=int8",
                      accepted=lambda: ["prefetch", "overlap_grads", "replicate_compression", "x"])
    assert v.options == (("prefetch", 0), ("overlap_grads", False), ("replicate_compression", None), ("x", "int8"))
    assert v.name == "hybridshard:prefetch=0,overlap_grads=false,replicate_compression=none,x=int8"
    with pytest.raises(ValueError, match=r"does not accept \['prefetch'\].*accepts \['debug'\]"):
        parse_variant("hybridshard:prefetch=0", accepted=lambda: ["debug"])
    with pytest.raises(ValueError, match="expected key=value pairs"):
        parse_variant("hybridshard:prefetch", accepted=lambda: ["prefetch"])
    assert "debug" in shard_options() and "groups" not in shard_options()  # the bench fixes groups/strategy/wrap
    from hybridshard.cli.bench import _variants

    assert _variants("hybridshard,hybridshard:a=1,b=2,hybridshard:c=3") == ["hybridshard", "hybridshard:a=1,b=2",
                                                                            "hybridshard:c=3"]
    both = contestants([System.FLOOR, System.HYBRIDSHARD], [Contestant(System.HYBRIDSHARD), v])
    assert [c.name for c in both] == ["floor", "hybridshard", v.name]
    with pytest.raises(ValueError, match="strategy must be one of"):
        BenchConfig(strategy="FULL_SHARD")


def test_stats():
    assert stats.quantile([3.0, 1.0, 2.0, 4.0], 0.5) == pytest.approx(2.5)
    assert stats.quantile([1.0, 2.0, 3.0, 4.0, 5.0], 0.1) == pytest.approx(1.4)
    t = stats.summarize([10.0, 30.0, 20.0])
    assert (t.median_ms, t.num_steps) == (20.0, 3)
    assert stats.ratios({"hybridshard": 90.0, "fsdp1": 100.0, "floor": 45.0}, "hybridshard") == {
        "fsdp1": pytest.approx(0.9), "floor": pytest.approx(2.0)}
    agreement = stats.loss_agreement({"a": [1.0, 2.0, 3.0], "b": [1.0, 2.5, 9.0], "floor": [1.1, 7.0]},
                                     reference="a", num_steps=2, first_step_only=["floor"])
    assert agreement == {"a": 0.0, "b": pytest.approx(0.5), "floor": pytest.approx(0.1)}
    assert stats.loss_agreement({"b": [1.0]}, reference="a", num_steps=1) == {"b": None}
    with pytest.raises(ValueError, match="no values"):
        stats.quantile([], 0.5)


def test_progress_lines_become_one_bar():
    worker_side = io.StringIO()
    p = Progress(2, enabled=True, machine=True, stream=worker_side)
    p.advance("warm-up fsdp1")
    p.advance("round 1/1 fsdp1")
    lines = worker_side.getvalue().splitlines()
    assert lines == [f"{TAG} 1 2 warm-up fsdp1", f"{TAG} 2 2 round 1/1 fsdp1"]
    shown = io.StringIO()
    sink = ProgressSink(shown)
    sink.write(f"[node0] {lines[0]}\n[node1] a warning\n[node0] {lines[1][:10]}")
    sink.write(lines[1][10:] + "\n")
    sink.close()
    out = shown.getvalue()
    assert TAG not in out and "[node1] a warning" in out
    assert "1/2 warm-up fsdp1" in out and "2/2 round 1/1 fsdp1" in out


class _Hooked:
    """Stands in for a system's hooks: ``outer`` calls ``inner``, both entry points."""

    def outer(self) -> int:
        time.sleep(0.01)
        return self.inner()

    def inner(self) -> int:
        time.sleep(0.01)
        return 3


def test_hook_clock_counts_outermost_entries_once_and_puts_originals_back(monkeypatch):
    from hybridshard.bench import hook_time

    original = _Hooked.outer
    monkeypatch.setitem(hook_time.ENTRY_POINTS, "fake", [(__name__, "_Hooked", "outer"),
                                                         (__name__, "_Hooked", "inner"),
                                                         (__name__, None, "_not_here")])
    clock = hook_time.HookClock().install(["fake"])
    clock.label = "a"
    assert _Hooked().outer() == 3 and _Hooked().inner() == 3
    assert clock.calls["a"] == 2 and clock.seconds["a"] >= 0.03  # inner inside outer counted with it
    assert clock.missing == [f"{__name__}._not_here"]
    clock.uninstall()
    assert _Hooked.outer is original
    with pytest.raises(ValueError, match="expected one of"):
        hook_time.HookClock().install(["nope"])


class _FakeUnit:
    def __init__(self) -> None:
        self.hook_seconds = 0.0


def test_runtime_hook_clock_charges_nested_entries_once_and_the_bench_reads_it():
    """One measurement: a nested entry's time goes to its own unit only, and the bench's clock gets the
    outermost entry's wall time from the runtime's clock (no wrapper of its own around hybridshard)."""
    from hybridshard.bench import hook_time
    from hybridshard.runtime.trace import hook_clock

    outer, inner = _FakeUnit(), _FakeUnit()
    clock = hook_time.HookClock().install(["hybridshard"])
    clock.label = "a"
    try:
        with hook_clock.timed(outer, "outer"):
            time.sleep(0.02)
            with hook_clock.timed(inner, "inner"):
                time.sleep(0.03)
        with hook_clock.thread_job("job"):
            pass
    finally:
        clock.uninstall()
    assert inner.hook_seconds >= 0.03 and outer.hook_seconds >= 0.02  # sum == outermost wall: exclusive
    assert clock.calls["a"] == 1
    assert clock.seconds["a"] == pytest.approx(outer.hook_seconds + inner.hook_seconds)
    assert set(clock.cpu_by_entry) == {("a", "outer"), ("a", "job")}
    with hook_clock.timed(outer, "after"):  # uninstalled: the runtime's clock goes on, the bench's not
        pass
    assert clock.calls["a"] == 1 and hook_clock.observe(None) is None


def test_a_second_hook_clock_is_refused_and_the_first_keeps_observing():
    from hybridshard.bench import hook_time
    from hybridshard.runtime.trace import hook_clock

    first = hook_time.HookClock().install(["hybridshard"])
    try:
        with pytest.raises(RuntimeError, match="^expected no other HookClock observing"):
            hook_time.HookClock().install(["hybridshard"])
        assert hook_clock.observe(first) is first  # still the observer after the refusal
    finally:
        first.uninstall()
    assert hook_clock.observe(None) is None


def test_live_bytes_count_storage_resizes():
    import torch

    from hybridshard.bench.live_bytes import LiveTensorBytes

    live = LiveTensorBytes()
    kept = torch.empty(0)
    with live, live.counting_resizes():
        kept.untyped_storage().resize_(4000)
        temporary = torch.ones(100)  # 400 bytes, freed below
        del temporary
        kept.untyped_storage().resize_(0)
    assert live.peak() == 4400 and live.live() == 0
    assert torch.UntypedStorage.resize_.__qualname__ != "counting_resizes.<locals>.resize_"


def test_live_bytes_follow_a_storage_that_outlives_its_tensors():
    """A flat parameter's first gather allocates with an op and hands the storage over with ``.data =``
    (no op sees that), then frees and regrows it with resizes: it must count as alive until it is
    freed, once, and ``alive_at_peak`` must list it. Found when the 405B-shaped rank's peak was short
    of its root's gathered buffer."""
    import torch

    from hybridshard.bench.live_bytes import LiveTensorBytes

    holder = torch.empty(0)
    with LiveTensorBytes() as live, live.counting_resizes():
        holder.data = torch.empty(1000)  # 4000 bytes; the op's own tensor dies here
        holder.untyped_storage().resize_(0)  # freed
        holder.untyped_storage().resize_(4000)  # and regrown
        other = torch.ones(100)  # 400 bytes beside it: the peak
        del other
        holder.untyped_storage().resize_(0)
        grown = torch.empty(0)
        grown.resize_(50)  # a tensor's resize_ grows its storage too: 200 bytes
    assert live.peak() == 4400, live.events
    assert live.live() == 200
    assert sorted(n for _, n in live.alive_at_peak().values()) == [400, 4000]


def test_compile_flag_adds_compiled_variants_and_the_compile_table():
    """``--compile``: each variant eager and compiled, FSDP2 compiled, and the compile reported apart."""
    import argparse

    from hybridshard.cli.bench import add_parser, config_from_args

    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    argv = ["bench", "--compile", "--variants", "hybridshard,hybridshard:compile=true"]
    cfg = config_from_args(parser.parse_args(argv))
    assert cfg.compile and [c.name for c in cfg.contestants] == ["hybridshard", "hybridshard:compile=true", "fsdp2"]
    assert not config_from_args(parser.parse_args(["bench"])).compile

    def entry(system, options, median, counts):
        first, frames, breaks, recompiles = counts
        return {"system": system, "options": options, "median_ms": median, "p10_ms": median, "p90_ms": median,
                "ratio": {"fsdp2": median / 40.0}, "loss_max_abs_diff": 0.0, "bytes_per_step": {},
                "peak_bytes": 1e6, "compile": {"first_step_ms": first, "frames_first_step": frames,
                                               "graph_breaks": breaks, "recompiles": recompiles}}

    results = {"strategy": "HYBRID_SHARD", "world_size": 2, "replicate_size": 1, "shard_size": 2, "link": "loopback",
               "device": "cpu", "backend": "gloo", "torch": "x", "threads_per_rank": 1, "reference": "hybridshard",
               "model": {"d_model": 8, "layers": 1, "heads": 1, "seq": 4, "global_batch": 2, "params": 10,
                         "dtype": "float32", "optimizer": "AdamW"},
               "schedule": {"warmup": 2, "rounds": 1, "steps_per_round": 1, "order": "rotated"},
               "max_rss_bytes_by_rank": [1e6], "compile": True,
               "systems": {"hybridshard": entry("hybridshard", {}, 50.0, (60.0, 0, 0, 0)),
                           "hybridshard:compile=true": entry("hybridshard", {"compile": True}, 30.0, (9000.0, 1, 0, 0)),
                           "fsdp2": entry("fsdp2", {}, 40.0, (6000.0, 3, 0, 0))}}
    text = render_text(results)
    row = next(line for line in text.splitlines() if line.startswith("hybridshard:compile=true") and "9.0" in line)
    assert row.split()[1:] == ["9.0", "1", "0", "0", "30.0", "0.60", "0.75"]  # /eager 30/50, /fsdp2 30/40


class _Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)).sum()


@pytest.mark.timeout(300)
def test_compile_counts_compile_every_contestant_cold():
    """``--compile``: a contestant compiling the same module code as another before it captures its own graph
    (dynamo's frame cache) and finds no inductor cache entry of the other's (nor of an earlier run's); graphs,
    hits and misses are counted per contestant."""
    from hybridshard.bench.compiled import CompileCounts, private_forward

    counts = CompileCounts()
    try:
        for name in ("first", "second"):
            torch.manual_seed(0)
            module = _Tiny()
            assert private_forward(module, _Tiny) == 1
            module.forward = torch.compile(module.forward)  # as shard(..., compile=True) does
            with counts.cold(name), counts.step(name):
                module(torch.randn(2, 4)).backward()
        root = counts._root
    finally:
        counts.close()
        torch._dynamo.reset()
    assert root is not None and not os.path.exists(root)
    for name in ("first", "second"):
        c = counts.facts(name)
        assert c["frames_first_step"] == 1 and c["graphs"] == 1, (name, c)
        # cold: FX graph and AOTAutograd caches looked up and missed, never hit
        assert c["fx_hits"] == 0 and c["fx_misses"] >= 1 and c["aot_hits"] == 0 and c["aot_misses"] >= 1, (name, c)
        assert c["frame_compile_s"] > 0 and c["backward_compile_s"] > 0, (name, c)  # torch's own clocks, per contestant
