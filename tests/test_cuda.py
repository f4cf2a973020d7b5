"""The CUDA path: NCCL with one rank, and two ranks sharing one GPU over gloo (needs a GPU).

Each case runs ``tests/cuda_job.py`` under torchrun, which compares every strategy (with and
without activation checkpointing) against the CPU reference, losses and parameters. On a machine
without CUDA these tests skip, saying so; the CPU suite covers the same runtime over gloo.
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


def _job(tmp_path, nproc: int, backend: str) -> dict:
    out = tmp_path / "summary.json"
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        str(ROOT / "tests" / "cuda_job.py"), "--backend", backend, "--out", str(out),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    return json.loads(out.read_text())


def test_nccl_one_rank_every_strategy_matches_reference(tmp_path):
    summary = _job(tmp_path, 1, "nccl")
    assert summary["device"] == "cuda:0" and summary["shard_groups"] == [[0]]
    assert len(summary["runs"]) == 10
    for name, run in summary["runs"].items():
        assert run["peak_cuda_bytes"] > 0, name


def test_gloo_two_ranks_share_one_gpu(tmp_path):
    summary = _job(tmp_path, 2, "gloo")
    assert summary["shard_groups"] == [[0, 1]]
    assert len(summary["runs"]) == 10
