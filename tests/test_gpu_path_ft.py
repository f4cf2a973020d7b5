"""``FaultTolerance`` in the GPU-path matrix (tests/test_gpu_path.py): the same fault-tolerant job under
the stream executor and under the emulated device (hybridshard/runtime/comm/executors/emulate.py).

Its own module because its process layout is its own: each replica group is a job of 2 gloo ranks
(tests/ft/cluster.py), 2 groups per run, one torchft lighthouse per run, both runs side by side
(``benchmarks/ft_worker.py``, HYBRID_SHARD, momentum SGD with a clip that never binds, so a gradient
off by a constant factor shows). Each run's lighthouse forms a quorum only with both groups, so
every step of both runs commits with both and the two runs take the same samples in the same steps.
The groups seed the same initial weights and run with ``init_sync=False``: the step-0 weight sync
(docs/fault-tolerance.md, "The contract") has nothing to do.

Required, as for every other entry of the matrix: the emulated run bitwise equal to ``streams`` (losses,
gradient norms, final parameters, every rank's master shards and optimizer state), and through it to
a plain replay in one process (each step's gradient the mean over the live groups, to 1e-6); from the
second step on no host sync in the runtime's code but fault-tolerant mode's two exempt ones, counted
by name and exactly: torchft's ``should_commit`` once a step, and the wait for torchft's gloo
all-reduce once per unit at the end of backward (see [Note: counting host syncs] in
hybridshard/runtime/trace/host_syncs.py).
"""

from __future__ import annotations

import json
from collections import Counter

import pytest

import torchft._torchft as torchft_lighthouse  # the ft extra is part of the test extra

from tests.ft.cluster import Group
from tests.test_ft import SGD_ARGS, _check_accounting, _check_against_reference, _committed, _read, _replay

pytestmark = pytest.mark.multiprocess

EXECUTORS = ("streams", "emulate")
STEPS = 4
GROUPS, RANKS = 2, 2
UNITS = 3
"""ft_worker's model: three ``nn.Linear`` units (the root holds no parameter of its own), each one
managed all-reduce a step."""
ARGS = ["--steps", str(STEPS), "--min-replicas", str(GROUPS), "--no-init-sync", "--timeout", "20", *SGD_ARGS]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, dict]:
    """Both runs, side by side; per executor the records, ``.done`` files and rank 0's full state of each group."""
    import torch

    lighthouses, groups = {}, {}
    try:
        for executor in EXECUTORS:
            logdir = str(tmp_path_factory.mktemp(executor))
            # A quorum needs both groups: no step runs with one while the other is still starting.
            lighthouses[executor] = torchft_lighthouse.LighthouseServer(
                bind="[::]:0", min_replicas=GROUPS, join_timeout_ms=1000, heartbeat_timeout_ms=1000)
            groups[executor] = [Group(i, RANKS, logdir) for i in range(GROUPS)]
            for g in groups[executor]:
                g.start(lighthouses[executor].address(), [*ARGS, "--executor", executor])
        failed = [f"{executor}:\n{g.output()}" for executor in EXECUTORS for g in groups[executor]
                  if g.wait(240) != [0] * RANKS]
        assert not failed, "\n".join(failed)
    finally:
        for gs in groups.values():
            for g in gs:
                g.kill()
        for lighthouse in lighthouses.values():
            lighthouse.shutdown()
    out = {}
    for executor, gs in groups.items():
        logs = {(g.replica, rank): g.log(rank) for g in gs for rank in range(RANKS)}
        done = {}
        for key, path in logs.items():
            with open(path + ".done") as f:
                done[key] = json.load(f)
        out[executor] = {"logs": logs, "records": {key: _read(path) for key, path in logs.items()}, "done": done,
                         "state": {g.replica: torch.load(g.log(0) + ".state.pt") for g in gs}}
    return out


@pytest.mark.parametrize("executor", EXECUTORS)
def test_every_step_commits_with_both_groups(runs, executor):
    for (replica, rank), records in runs[executor]["records"].items():
        got = [(r["step"], r["committed"], r["replicas"], r["batches"]) for r in records]
        assert got == [(s, True, GROUPS, GROUPS * (s - 1)) for s in range(1, STEPS + 1)], (replica, rank, got)
        assert {r["participant"] for r in records} == {replica}, (replica, rank, records)
    for rank in range(RANKS):  # check_replicas compared both groups: shard rank ``rank`` is bitwise the same in each
        done = [runs[executor]["done"][(replica, rank)] for replica in range(GROUPS)]
        assert all(d["compared"] == GROUPS for d in done) and len({d["digest"] for d in done}) == 1, done


def test_emulated_device_is_bitwise_the_stream_executor(runs):
    """Losses, gradient norms, every rank's master shards and optimizer state (the digest) and the
    full parameters: the emulated run's bits are the stream executor's."""
    import torch

    streams, emulated = runs["streams"], runs["emulate"]
    for key, records in streams["records"].items():
        a = [(r["step"], r["loss"], r["grad_norm"]) for r in emulated["records"][key]]
        b = [(r["step"], r["loss"], r["grad_norm"]) for r in records]
        assert a == b, f"replica group {key[0]} rank {key[1]}: the emulated device changed losses or norms"
        assert emulated["done"][key]["digest"] == streams["done"][key]["digest"], key
    for replica, state in streams["state"].items():
        assert set(emulated["state"][replica]) == set(state)
        for name, value in state.items():
            assert torch.equal(emulated["state"][replica][name], value), f"replica group {replica}: {name} differs"


@pytest.mark.parametrize("executor", EXECUTORS)
def test_matches_the_plain_reference(runs, executor):
    """Each step's gradient is the mean over the live groups' (test_ft.py's replay, to 1e-6): a gradient
    summed instead of averaged, or counted twice, moves the norm and the momentum-SGD parameters."""
    run = runs[executor]
    lives = [run["records"][(replica, 0)] for replica in range(GROUPS)]
    history = _committed(*lives)
    _check_accounting(history, lives)
    per_step, final = _replay(history)
    _check_against_reference(per_step, final, [run["records"][(r, k)] for r in range(GROUPS) for k in range(RANKS)],
                             [run["logs"][(replica, 0)] for replica in range(GROUPS)])


def test_no_host_sync_in_steady_state_steps_but_torchfts_own(runs):
    """From the second step on: no hot-path sync; exempt, by name, one ``should_commit`` a step and one
    wait for torchft's gloo all-reduce per unit at the end of each backward (counted under the step
    that backward ends; ``should_commit`` comes after it, under the next)."""
    assert all(d["host_syncs"] is None for d in runs["streams"]["done"].values())
    steady = range(2, STEPS + 1)
    expected = Counter({(s, "other", "torchft should_commit"): 1 for s in steady})
    expected.update({(s - 1, "backward", "torchft all-reduce wait"): UNITS for s in steady})
    for (replica, rank), done in runs["emulate"]["done"].items():
        syncs = done["host_syncs"]
        assert syncs["hot"] == [], f"replica group {replica} rank {rank}: host syncs in the hot path {syncs['hot']}"
        exempt = Counter({(step, phase, site): n for step, phase, site, n in syncs["exempt"]})
        assert exempt == expected, (replica, rank, sorted(exempt.items()))
