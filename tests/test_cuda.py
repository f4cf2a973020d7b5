"""The CUDA path: NCCL with one rank, and two ranks sharing one GPU over gloo (needs a GPU).

Each case runs ``tests/cuda_job.py`` under torchrun, which compares every strategy in five variants
(fp32, activation checkpointing, bf16, fp16 with the sharded grad scaler, CPU offload) against the
CPU reference, losses and parameters, on the stream executor, and measures peak CUDA memory per
strategy against the planner. On a machine without CUDA these tests skip, saying so; the CPU suite
covers the same runtime over gloo (tests/test_gpu_path.py runs the stream executor's rules there).
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys

import pytest
import torch

ROOT = pathlib.Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine")

NUM_RUNS = 5 * 5
"""Strategies x variants (see tests/cuda_job.py)."""


def _job(tmp_path, nproc: int, backend: str) -> dict:
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "cuda_job.py"), "--backend", backend, "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=420)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    print(done.stdout)  # the peak-memory table (shown with pytest -s, as make gpu-check runs it)
    return json.loads(out.read_text())


def _check(summary: dict) -> None:
    assert len(summary["runs"]) == NUM_RUNS, sorted(summary["runs"])
    for name, run in summary["runs"].items():
        assert run["peak_cuda_bytes"] > 0, name
        # One rank needs no collective (every group has one member: local copies); two ranks do.
        assert (run["collectives"] > 0) == (summary["world_size"] > 1), (name, run["collectives"])
        assert all(len(threads) == 1 for threads in run["issuing_threads"].values()), (name, run["issuing_threads"])
    assert set(summary["memory"]) == {"FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"}


def test_nccl_one_rank_every_strategy_matches_reference(tmp_path):
    summary = _job(tmp_path, 1, "nccl")
    assert summary["device"] == "cuda:0" and summary["shard_groups"] == [[0]]
    _check(summary)


def test_gloo_two_ranks_share_one_gpu(tmp_path):
    summary = _job(tmp_path, 2, "gloo")
    assert summary["shard_groups"] == [[0, 1]]
    _check(summary)


def _large_job(tmp_path, nproc: int, backend: str) -> dict:
    out = tmp_path / "large.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "cuda_large_job.py"), "--backend", backend, "--dir", str(tmp_path), "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("nproc,backend", [(1, "nccl"), (2, "gloo")])
def test_meta_init_load_and_export_on_cuda(tmp_path, nproc, backend):
    """A tiny Llama built on meta, sharded on the GPU, loaded from safetensors and exported: the logits
    equal ``from_pretrained``'s, and the init allocated no more than the shards plus one unit (+10 %)."""
    summary = _large_job(tmp_path, nproc, backend)
    print(summary)
    assert summary["on_device"] and summary["world"] == nproc
    assert summary["load_max_diff"] <= 1e-4 and summary["export_max_diff"] <= 1e-4, summary
    assert summary["bytes_read"] <= summary["bytes_model"]
    # The caching allocator rounds each block up to 512 bytes: one block per tensor of the unit in init.
    slack = 512 * summary["init_tensors"]
    assert summary["init_peak_cuda_bytes"] <= 1.1 * (summary["shards_bytes"] + summary["unit_bytes"]) + slack, summary
