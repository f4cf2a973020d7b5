"""The control plane at 64 and 256 ranks (threads of this process, one real TCPStore): a dead rank is
named by every survivor, a stall of rank 0 longer than HYBRIDSHARD_FAULT_SECONDS reports nobody, and
the store load and init bytes stay within their budgets (see docs/scale.md)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

HARNESS = Path(__file__).resolve().parents[1] / "benchmarks" / "control_plane_scale.py"


@pytest.fixture(scope="module")
def harness():
    spec = importlib.util.spec_from_file_location("control_plane_scale", HARNESS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [64, 256])
def test_control_plane_at_scale(harness, world, monkeypatch):
    monkeypatch.delenv("HYBRIDSHARD_FAULT_SECONDS", raising=False)
    monkeypatch.delenv("HYBRIDSHARD_HANG_SECONDS", raising=False)
    r = harness.run(world, fault_s=1.0, healthy_s=2.0, faults=True)
    # A stall of rank 0 (1.5 s against a 1 s fault limit, every other rank checking at once): nobody reported.
    assert r["stall_checks"] >= world // 2 and r["false_reports"] == 0, r
    # Rank world//2+1 stops: every survivor names it, after the limit and the 3 s + 9 s of silence.
    assert r["detected"] == r["survivors"] == world - 1, r
    assert r["detect_s"] < 1.0 + 4 * 3.0 + 10.0, r  # generous: a loaded 2-core machine
    assert r["store_ops_per_rank_per_s"] <= 1.05, r  # one heartbeat a second
    assert r["store_ops_per_check_per_rank"] <= 10, r
    # The ranks checking at once share one reading ([Note: one reading for the ranks asking at once]):
    # asking alone, each read every heartbeat twice (2 multi_gets; 31 KB a check at 64 ranks, 124 KB at 256).
    assert r["store_multi_get_per_check_per_rank"] <= 0.25, r
    assert r["store_bytes_per_check_per_rank"] <= 8 * 1024, r
    # Every rank created every group (build_groups, new_group on the threaded group) and got its own
    # (the phase checks each rank's sizes). A group's members meet once at the store: a few
    # operations a rank whatever W, not one meeting of every rank per group (W/8 + 8 of them).
    assert r["groups_calls_per_rank"] == world // 8 + 8, r
    assert r["groups_store_ops_per_rank"] <= 8, r
    if world == 256:
        assert r["init_bytes_per_rank"] <= 64 * 1024, r
        assert r["init_bytes_max_rank"] <= 64 * 1024, r  # rank 0 and the block leaders of the gather tree


def test_harness_leaves_the_fault_limits_as_it_found_them(harness, monkeypatch):
    # Its phases set HYBRIDSHARD_FAULT_SECONDS and HANG_SECONDS; left set, every later test's ranks
    # (subprocesses of this pytest process) ran with a 1 s fault limit and stopped healthy ranks.
    monkeypatch.delenv("HYBRIDSHARD_FAULT_SECONDS", raising=False)
    monkeypatch.setenv("HYBRIDSHARD_HANG_SECONDS", "300")
    harness.run(8, fault_s=1.0, healthy_s=0.5, faults=True)
    import os

    assert "HYBRIDSHARD_FAULT_SECONDS" not in os.environ and os.environ["HYBRIDSHARD_HANG_SECONDS"] == "300"


@pytest.mark.timeout(240)
def test_ranks_spread_over_worker_processes_make_one_job(harness, monkeypatch):
    """The process form (``--processes``, for W beyond what one interpreter runs on time): every
    survivor in either worker names the dead rank, the stall reports nobody, and the counts are the
    whole job's (a worker's share alone would give half the heartbeats and half the survivors)."""
    monkeypatch.delenv("HYBRIDSHARD_FAULT_SECONDS", raising=False)
    monkeypatch.delenv("HYBRIDSHARD_HANG_SECONDS", raising=False)
    r = harness.run(32, fault_s=1.0, healthy_s=2.0, faults=True, processes=2)
    assert r["processes"] == 2 and r["stall_checks"] >= 16 and r["false_reports"] == 0, r
    assert r["detected"] == r["survivors"] == 31, r
    assert 0.6 <= r["store_ops_per_rank_per_s"] <= 1.05, r
    assert r["store_multi_get_per_check_per_rank"] <= 0.25 and r["store_ops_per_check_per_rank"] <= 10, r
