"""Kill one rank mid-training; the job resumes from the latest checkpoint and finishes with the
parameters and losses of a run that was never interrupted. Two ways:

* relaunched: the job stops, and is launched again with ``--resume`` (over the static rendezvous);
* restarted in place: ``hybridshard launch --max-restarts 1`` restarts every rank of both nodes,
  which resume by themselves (see [Note: restarts] in hybridshard/launcher/settings.py).

Two torchrun agents on this host act as two nodes (``HYBRIDSHARD_NODE_NAME``), 2 ranks each, on
loopback, as ``examples/demo.sh --no-netns`` runs them. Every agent runs in its own session, so a
hang kills it with its workers after the timeout.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

from hybridshard.launcher.local_cluster import free_port
from tests.mp import held_store

pytestmark = pytest.mark.multiprocess

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXAMPLE = os.path.join(REPO, "examples", "train_gpt.py")
SMALL = ["--steps", "6", "--dim", "32", "--heads", "2", "--layers", "2", "--seq-len", "16", "--vocab", "64",
         "--batch-size", "8", "--timeout-s", "30"]
KILL = ["--kill-rank", "3", "--kill-at-step", "5"]


def _rendezvous(port: int, restarts: int | None) -> list[str]:
    """c10d at the test's own store (see ``held_store``): the agents find its port taken and connect
    to it, so no probe-then-bind race; node ranks come from the rendezvous, which the results do not
    depend on (groups follow the nodes the ranks report)."""
    return ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
            *(["--max-restarts", str(restarts)] if restarts is not None else [])]


def _static(port: int, node: int) -> list[str]:
    """The static rendezvous SLURM scripts use: node 0's agent hosts the store at ``port``."""
    return ["--node-rank", str(node), "--master-addr", "127.0.0.1", "--master-port", str(port)]


def _run_cluster(tmp_path, name: str, extra: list[str], *, restarts: int | None = None, fails: bool = False,
                 timeout: float = 90, static: bool = False):
    """Two agents (nodes) x 2 ranks; returns rank 0's JSON result, final state, and both agents' output.

    ``static``: the static rendezvous, whose store node 0's agent binds itself, so its port can only be
    probed; if another process took it in between (node 0 says the address is in use), the run is
    tried again on another port, at most twice more."""
    if not static:
        with held_store() as store:
            return _run_agents(tmp_path, name, extra, lambda node: _rendezvous(store.port, restarts),
                               fails=fails, timeout=timeout)
    for attempt in range(3):
        port = free_port()
        try:
            return _run_agents(tmp_path, f"{name}{attempt}", extra, lambda node: _static(port, node), fails=fails,
                               timeout=timeout)
        except AssertionError as err:
            if "EADDRINUSE" not in str(err) and "ddress already in use" not in str(err):
                raise
    raise AssertionError(f"port taken by another process in each of 3 static rendezvous: {name}")


def _run_agents(tmp_path, name: str, extra: list[str], rendezvous, *, fails: bool, timeout: float):
    out_json, out_state = tmp_path / f"{name}.json", tmp_path / f"{name}.pt"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "TORCHELASTIC_", "TORCH_DISABLE"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=REPO, TORCH_CPP_LOG_LEVEL="ERROR")
    procs = []
    for node in range(2):
        argv = [sys.executable, "-m", "hybridshard", "launch", "--nnodes", "2", "--nproc-per-node", "2",
                *rendezvous(node), "--monitor-interval", "0.2", "--", EXAMPLE, *SMALL, *extra,
                "--json-out", str(out_json), "--state-out", str(out_state)]
        procs.append(subprocess.Popen(argv, env={**env, "HYBRIDSHARD_NODE_NAME": f"node{node}"}, cwd=tmp_path,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for p in procs:
            try:
                outputs.append(p.communicate(timeout=timeout)[0])
            except subprocess.TimeoutExpired:
                for q in procs:  # the agent, torchrun and the workers: one session each
                    if q.poll() is None:
                        os.killpg(q.pid, signal.SIGKILL)
                raise
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    text = "\n".join(f"--- node{i}\n{o}" for i, o in enumerate(outputs))
    if fails:
        assert all(p.returncode != 0 for p in procs), text
        return None, None, text
    assert all(p.returncode == 0 for p in procs), text
    with open(out_json) as f:
        return json.load(f), torch.load(out_state), text


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """The uninterrupted run: rank 0's JSON result and final full state dict."""
    result, state, _ = _run_cluster(tmp_path_factory.mktemp("plain"), "plain", [])
    assert result["start_step"] == 0 and len(result["losses"]) == 6 and not any(result["restart_counts"])
    return result, state


def _assert_matches(plain, result, state):
    plain_result, plain_state = plain
    assert result["losses"] == plain_result["losses"][4:]  # exactly: same ranks, same groups, same data
    assert set(state) == set(plain_state)
    for key, value in plain_state.items():
        assert torch.equal(state[key], value), key


def test_killed_rank_resumes_and_matches_the_uninterrupted_run(tmp_path, plain):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--resume"]
    _, _, text = _run_cluster(tmp_path, "killed", [*ckpt, *KILL], fails=True)
    assert "rank 3: killing myself at step 5" in text and "step    4" in text and "step    5" not in text, text
    # Relaunched as a SLURM script would, with the static rendezvous (the plain run used c10d's): node
    # ranks are fixed by --node-rank there; the groups, and so the results, follow the nodes' names.
    resumed, state, text = _run_cluster(tmp_path, "resumed", ckpt, static=True)
    assert "step_00000004: continuing at step 4" in text, text
    assert resumed["start_step"] == 4 and len(resumed["losses"]) == 2
    _assert_matches(plain, resumed, state)


def test_killed_rank_restarts_in_place_and_matches_the_uninterrupted_run(tmp_path, plain):
    ckpt = ["--checkpoint-dir", str(tmp_path / "ckpt"), "--save-every", "2", "--resume"]
    restarted, state, text = _run_cluster(tmp_path, "restarted", [*ckpt, *KILL], restarts=1)
    # One kill, in the first attempt; then every rank of both nodes started again and resumed.
    assert text.count("rank 3: killing myself at step 5") == 1, text
    assert "step_00000004: continuing at step 4" in text, text
    assert restarted["start_step"] == 4 and len(restarted["losses"]) == 2
    # The killed rank's agent counted its restart; the other agent restarted because its peer re-joined
    # the rendezvous, which torchrun does not count (see [Note: restart count] in examples/train_gpt.py).
    counts = restarted["restart_counts"]
    assert counts[3] == counts[2] == 1 and set(counts) <= {0, 1}, counts
    _assert_matches(plain, restarted, state)
