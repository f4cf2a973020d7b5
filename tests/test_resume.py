"""Kill one rank mid-training: the job stops, is launched again with ``--resume``, loads the latest
checkpoint and finishes with the parameters and losses of a run that was never interrupted.

Two torchrun agents on this host act as two nodes (``HYBRIDSHARD_NODE_NAME``), 2 ranks each, over a
static rendezvous on loopback, as ``examples/demo.sh --no-netns`` runs them. The relaunch is done
here rather than by torchrun's ``--max-restarts`` (see docs/checkpointing.md, "Restarts").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")
SMALL = ["--steps", "6", "--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "16", "--vocab", "64",
         "--batch-size", "8", "--timeout-s", "30"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cluster(tmp_path, name: str, extra: list[str], *, fails: bool = False, timeout: float = 180):
    """Two agents (nodes) x 2 ranks; returns rank 0's JSON result, final state, and both agents' output."""
    port = _free_port()
    out_json, out_state = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, TORCH_CPP_LOG_LEVEL="ERROR")
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "hybridshard", "launch", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                "--monitor-interval", "0.2", "--", EXAMPLE, *SMALL, *extra,
                "--json-out", str(out_json), "--state-out", str(out_state)]
        procs.append(subprocess.Popen(argv, env={**env, "HYBRIDSHARD_NODE_NAME": f"node{node}"}, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=timeout)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    text = "\n".join(f"--- node{i}\n{o}" for i, o in enumerate(outputs))
    if fails:
        assert all(p.returncode != 0 for p in procs), text
        return None, None, text
    assert all(p.returncode == 0 for p in procs), text
    with open(out_json) as f:
        return json.load(f), torch.load(out_state), text


def test_killed_rank_resumes_and_matches_the_uninterrupted_run(tmp_path):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--resume"]
    _, _, text = _run_cluster(tmp_path, "killed", [*ckpt, "--kill-rank", "3", "--kill-at-step", "5"], fails=True)
    assert "rank 3: killing myself at step 5" in text and "step    4" in text and "step    5" not in text, text
    resumed, state, text = _run_cluster(tmp_path, "resumed", ckpt)
    assert "step_00000004: continuing at step 4" in text, text
    assert resumed["start_step"] == 4 and len(resumed["losses"]) == 2
    plain, plain_state, _ = _run_cluster(tmp_path, "plain", [])
    assert plain["start_step"] == 0 and len(plain["losses"]) == 6
    assert resumed["losses"] == plain["losses"][4:]  # exactly: same ranks, same groups, same data
    assert set(state) == set(plain_state)
    for key, value in plain_state.items():
        assert torch.equal(state[key], value), key
