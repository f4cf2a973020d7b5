"""Fault-tolerant HYBRID_SHARD on torchft: a replica group killed mid-run, the others go on, it heals.

Each replica group is its own job of gloo ranks: on `launch/local-cluster` hosts, or on 127.0.0.1
(tests/ft/cluster.py) with its own simulated node name and one lighthouse in this process. See
docs/fault-tolerance.md.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys

import pytest

import torchft._torchft as torchft_lighthouse  # the ft extra is part of the test extra

from tests.ft.cluster import Group, wait_for

pytestmark = pytest.mark.multiprocess


SGD_ARGS = ["--optimizer", "sgd", "--clip", "1e6"]
"""Momentum SGD and a clip that never binds: a gradient off by a constant factor (a sum instead of the
mean over groups, a healing group counted) changes the parameters and the logged norm."""
BATCH = 8  # the worker's --batch


def _committed(*lives: list[dict]) -> list[dict]:
    """The committed steps in order, each once, from the logs of several groups (a group that joined
    late, or healed, holds only the steps from then on)."""
    by_step: dict[int, dict] = {}
    for records in lives:
        for r in records:
            if r["committed"]:
                by_step.setdefault(r["step"], r)
    return [by_step[step] for step in sorted(by_step)]


def _replay(history: list[dict]) -> tuple[dict[int, dict], dict]:
    """One plain process over the committed steps of ``history`` (from :func:`_committed`): each
    step's gradient is the mean over its ``replicas`` live groups of the MSE gradient on group ``r``'s
    samples (the batch after ``batches + r`` batches), then a momentum-SGD update written out here.
    Returns, per step, every group's loss and the norm of the mean gradient; and the final parameters."""
    import torch

    from benchmarks import ft_worker as W

    model, x, y = W.model_and_data(seed=0)
    params = list(model.parameters())
    velocity = [torch.zeros_like(p) for p in params]
    per_step = {}
    for rec in history:
        n, done = rec["replicas"], rec["batches"]
        mean = [torch.zeros_like(p) for p in params]
        losses = []
        for r in range(n):
            index = torch.tensor([((done + r) * BATCH + i) % x.shape[0] for i in range(BATCH)])
            loss = torch.nn.functional.mse_loss(model(x[index]), y[index])
            for m, g in zip(mean, torch.autograd.grad(loss, params)):
                m += g
            losses.append(loss.item())
        with torch.no_grad():
            for p, v, m in zip(params, velocity, mean):
                m /= n
                v.mul_(W.SGD_MOMENTUM).add_(m)
                p.sub_(W.SGD_LR * v)
        per_step[rec["step"]] = {"losses": losses, "norm": math.sqrt(sum(float((m * m).sum()) for m in mean)),
                                 "batches": done, "replicas": n}
    return per_step, {k: v.detach() for k, v in model.state_dict().items()}


def _check_accounting(history: list[dict], lives: list[list[dict]]) -> None:
    """Committed steps (``history``) count up by one from the first and each takes the batches after
    the previous step's: every sample once. In each process's records (``lives``), a step that did
    not commit is retried on the same samples."""
    assert history and history[0]["step"] == 1 and history[0]["batches"] == 0, history[:1]
    for before, after in zip(history, history[1:]):
        assert after["step"] == before["step"] + 1, (before, after)
        assert after["batches"] == before["batches"] + before["replicas"], (before, after)
    for records in lives:
        for before, after in zip(records, records[1:]):
            if not before["committed"] and before["participant"] is not None:
                assert after["batches"] == before["batches"], (before, after)


def _check_against_reference(per_step: dict, final: dict, lives: list[list[dict]], logs: list[str], *,
                             tol: float = 1e-6) -> None:
    """The committed steps of each process's records (``lives``, only those in the history) against the
    replay: the same samples and groups, this group's loss (so the parameters before the step), the
    norm of the averaged gradient; and each group's final parameters (the ``.state.pt`` of ``logs``)."""
    import torch

    for records in lives:
        for rec in (r for r in records if r["committed"] and r["step"] in per_step):
            ref = per_step[rec["step"]]
            assert (rec["batches"], rec["replicas"]) == (ref["batches"], ref["replicas"]), (rec, ref)
            if rec["participant"] is not None:  # a healing group computes on borrowed samples, not counted
                assert abs(rec["loss"] - ref["losses"][rec["participant"]]) <= tol, (rec, ref)
            assert abs(rec["grad_norm"] - ref["norm"]) <= tol * max(1.0, ref["norm"]), (rec, ref)
    for path in logs:
        state = torch.load(path + ".state.pt")
        assert set(state) == set(final), (sorted(state), sorted(final))
        for key, value in final.items():
            torch.testing.assert_close(state[key], value, atol=tol, rtol=0, msg=lambda m: f"{path} {key}: {m}")


def _lighthouse(min_replicas: int = 1):
    # A lost group stops heartbeating: after 1 s it is dead and a quorum forms without it.
    return torchft_lighthouse.LighthouseServer(bind="[::]:0", min_replicas=min_replicas, join_timeout_ms=1000,
                                               heartbeat_timeout_ms=1000)


@contextlib.contextmanager
def _cleaned_up(groups: list[Group], lighthouse):
    """Every group's processes killed and the lighthouse stopped, however the block ends."""
    try:
        yield
    finally:
        for g in groups:
            g.kill()
        lighthouse.shutdown()


def _stop_soon(stop_file, logs: list[str]) -> None:
    """Let the workers stop a few steps from now: every group is in the quorum by then (see --stop-file)."""
    import os

    last = max(_read(log)[-1]["step"] for log in logs if os.path.exists(log))
    tmp = f"{stop_file}.tmp"
    with open(tmp, "w") as f:
        f.write(str(last + 5))
    os.replace(tmp, stop_file)


def _done(group: Group, rank: int) -> dict:
    with open(group.log(rank) + ".done") as f:
        return json.load(f)


def _loopback_kill_and_heal(tmp_path, args: list[str], stop_file) -> tuple[dict, int]:
    """The loopback form: groups of processes on 127.0.0.1, killed and started again from here."""
    lighthouse = _lighthouse()
    groups = [Group(i, 2, str(tmp_path)) for i in range(3)]
    with _cleaned_up(groups, lighthouse):
        for g in groups:
            g.start(lighthouse.address(), args)
        wait_for(lambda: any(r["replicas"] == 3 for r in groups[2].records()), 120,
                 "a step of replica group 2 with all 3 groups", groups)
        killed_at = groups[2].step()
        groups[2].kill()
        wait_for(lambda: all(sum(r["committed"] and r["replicas"] == 2 for r in g.records()) >= 3 for g in groups[:2]),
                 60, "3 steps committed by the 2 surviving groups", groups[:2])
        groups[2].start(lighthouse.address(), args)
        back = groups[2].procs[0].pid
        wait_for(lambda: any(r["pid"] == back and r["replicas"] == 3 for r in groups[2].records()), 120,
                 "replica group 2 back in a step of all 3", groups)
        _stop_soon(stop_file, [g.log(0) for g in groups])
        for g in groups:
            assert g.wait(120) == [0, 0], g.output()
    logs = {(g.replica, rank): g.log(rank) for g in groups for rank in range(2)}
    return logs, killed_at


def _namespace_kill_and_heal(tmp_path, args: list[str], stop_file) -> tuple[dict, int]:
    """The namespace form: `launch/local-cluster` with 3 hosts, host2 killed and brought back by it."""
    import os
    import subprocess
    import time

    from tests.ft.cluster import ROOT, WORKER

    out = str(tmp_path / "{node}_rank{rank}.jsonl")
    logs = {(i, rank): out.format(node=f"host{i}", rank=rank) for i in range(3) for rank in range(2)}
    output = tmp_path / "local-cluster.out"
    cluster = subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "launch", "local-cluster"), "--nodes", "3", "--procs-per-node", "2",
         "--launch-arg=--fault-tolerant", "--kill-host", "2", "--kill-when", '"replicas": 3,',
         "--restart-after", "0", "--timeout", "200", "--", sys.executable, WORKER, "--out", out, *args],
        stdout=open(output, "w"), stderr=subprocess.STDOUT, env=dict(os.environ, RUST_LOG="error", PYTHONPATH=ROOT))
    try:
        deadline = time.monotonic() + 200
        while True:  # host2's second life in a step of all 3 hosts
            recs = _read(logs[(2, 0)]) if os.path.exists(logs[(2, 0)]) else []
            if len({r["pid"] for r in recs}) > 1 and recs[-1]["replicas"] == 3:
                break
            assert time.monotonic() < deadline and cluster.poll() is None, output.read_text()[-5000:]
            time.sleep(0.1)
        _stop_soon(stop_file, [logs[(i, 0)] for i in range(3)])
        assert cluster.wait(120) == 0, output.read_text()[-5000:]
    finally:
        if cluster.poll() is None:
            cluster.terminate()  # local-cluster stops every host and removes the network
            cluster.wait(30)
    assert "killed host2" in output.read_text()
    first_life = _read(logs[(2, 0)])
    return logs, next(r["step"] for r in first_life if r["replicas"] == 3)


def _read(path: str) -> list[dict]:
    with open(path) as f:
        lines = f.read().split("\n")
    return [json.loads(line) for line in lines[:-1] if line.strip()]  # the last one may be half-written


def test_lost_replica_group_others_continue_then_it_heals(tmp_path):
    """3 replica groups x 2 ranks, HYBRID_SHARD; group 2's processes are killed once all 3 groups
    committed a step, then started again; the groups train until a few steps after it is back.

    On `launch/local-cluster` (3 hosts, host2 killed and brought back by it) where network
    namespaces can be created, else as process groups on 127.0.0.1. Groups 0 and 1 never restart
    (one process per rank, the step counter goes up by one per committed step, finite losses) and
    commit steps with 2 replicas after the kill; the restarted group 2 starts far past the step it
    died at (it healed from a live group), and every rank's master shards and optimizer state end
    bitwise equal to the same shard rank's in every group, which ``check_replicas`` confirms for 3.
    Against arithmetic (momentum SGD, unclipped): every committed step took the samples after the
    previous one's, and its losses, gradient norm and the final parameters equal a plain replay in
    which each step's gradient is the mean over that step's live groups (to 1e-6).
    """
    from hybridshard.launcher.netns import check_rights

    stop_file = tmp_path / "stop"
    args = ["--stop-file", str(stop_file), "--until-replicas", "3", "--sleep", "0.05", "--timeout", "5", *SGD_ARGS]
    form = _loopback_kill_and_heal if check_rights() is not None else _namespace_kill_and_heal
    logs, killed_at = form(tmp_path, args, stop_file)
    for (replica, rank), path in logs.items():
        recs = _read(path)
        assert all(math.isfinite(r["loss"]) for r in recs)
        if replica < 2:
            assert len({r["pid"] for r in recs}) == 1, "a surviving group restarted"
            steps = [r["step"] for r in recs if r["committed"]]
            assert steps == list(range(steps[0], steps[0] + len(steps))), steps
            assert any(r["replicas"] == 2 and r["step"] > killed_at for r in recs if r["committed"])
            assert any(r["replicas"] == 3 for r in recs if r["committed"])
        else:
            pids = list(dict.fromkeys(r["pid"] for r in recs))
            assert len(pids) == 2, "group 2 was not killed and started again"
            second = [r for r in recs if r["pid"] == pids[1]]
            assert second[0]["step"] > killed_at + 2, (killed_at, second[:2])  # healed: it skipped the steps it missed
    for rank in range(2):
        done = []
        for replica in range(3):
            with open(logs[(replica, rank)] + ".done") as f:
                done.append(json.load(f))
        assert len({d["step"] for d in done}) == 1 and done[0]["step"] > killed_at, done
        assert all(d["compared"] == 3 and d["loss_finite"] for d in done), done
        assert len({d["digest"] for d in done}) == 1, f"shard rank {rank} differs across replica groups: {done}"
    # Against arithmetic, over the committed steps of every group (one may have started alone).
    lives = [_read(logs[(replica, 0)]) for replica in range(3)]
    history = _committed(*lives)
    _check_accounting(history, lives)
    assert any(r["replicas"] == 2 for r in history) and any(r["replicas"] == 3 for r in history)
    per_step, final = _replay(history)
    _check_against_reference(per_step, final, lives, [logs[(replica, 0)] for replica in range(3)])


def test_missing_torchft_names_the_extra(monkeypatch):
    from hybridshard.ft.mode import import_torchft

    monkeypatch.setitem(sys.modules, "torchft", None)
    with pytest.raises(ImportError, match=r"pip install hybridshard\[ft\]"):
        import_torchft()


def test_launch_restarts_a_lost_nodes_workers_alone(tmp_path):
    """Two `hybridshard launch --fault-tolerant` agents on 127.0.0.1, one rank each. Node 1's worker is
    killed; its agent restarts it (--max-restarts 1), node 0's worker goes on, and the new worker heals."""
    import contextlib
    import os
    import signal
    import subprocess
    import time

    from tests.ft.cluster import ROOT, WORKER
    from tests.mp import held_store

    lighthouse = _lighthouse()
    # Each node runs a one-node job on a port of its own (see [Note: fault-tolerant launch]); the endpoint
    # names a port this test holds, so whatever binds or dials it finds the test's store, not a stranger.
    held = contextlib.ExitStack()
    port = held.enter_context(held_store()).port
    logs = [str(tmp_path / f"node{i}.jsonl") for i in range(2)]
    agents = []

    def records(i):
        try:
            with open(logs[i]) as f:
                return [json.loads(line) for line in f if line.strip()]
        except FileNotFoundError:
            return []

    def output():
        return "\n".join(open(f"{log}.out", errors="replace").read()[-3000:] for log in logs)

    try:
        for i in range(2):
            env = dict(os.environ, HYBRIDSHARD_NODE_NAME=f"node{i}", OMP_NUM_THREADS="1", RUST_LOG="error",
                       PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
            cmd = [sys.executable, "-m", "hybridshard", "launch", "--fault-tolerant", "--nnodes", "2",
                   "--node-rank", str(i), "--rdzv-endpoint", f"127.0.0.1:{port}", "--nproc-per-node", "1",
                   "--max-restarts", "1", "--lighthouse", lighthouse.address(), WORKER, "--out", logs[i],
                   "--stop-file", str(tmp_path / "stop"), "--until-replicas", "2", "--sleep", "0.05", "--timeout", "5"]
            agents.append(subprocess.Popen(cmd, env=env, stdout=open(f"{logs[i]}.out", "wb"),
                                           stderr=subprocess.STDOUT, start_new_session=True))
        deadline = time.monotonic() + 90
        while not any(r["replicas"] == 2 for r in records(1)):  # node 0 cannot finish before it is back
            assert time.monotonic() < deadline, "node 1 never committed a step with node 0\n" + output()
            assert all(a.poll() is None for a in agents), output()
            time.sleep(0.05)
        killed = records(1)[-1]
        os.kill(killed["pid"], signal.SIGKILL)
        while not any(r["pid"] != killed["pid"] and r["replicas"] == 2 for r in records(1)):
            assert time.monotonic() < deadline + 60, "node 1's new worker never joined node 0\n" + output()
            time.sleep(0.05)
        _stop_soon(tmp_path / "stop", logs)
        for a in agents:
            assert a.wait(120) == 0, output()
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
        for i in range(2):  # torchrun's workers have sessions of their own: not in the agent's group
            for pid in {r["pid"] for r in records(i)}:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        lighthouse.shutdown()
        held.close()
    assert len({r["pid"] for r in records(0)}) == 1
    second = [r for r in records(1) if r["pid"] != killed["pid"]]
    assert second and second[0]["step"] > killed["step"], "the restarted worker did not heal"
    done = []
    for log in logs:
        with open(log + ".done") as f:
            done.append(json.load(f))
    assert done[0]["digest"] == done[1]["digest"] and done[0]["compared"] == 2, done


def test_every_replica_lost_resumes_from_the_last_checkpoint(tmp_path):
    """2 replica groups x 1 rank save a checkpoint every 3 steps; both are killed, then started again
    from other initial weights (one seed per group): they resume at the checkpoint's step (no live
    replica to heal from), end bitwise equal, and equal a plain replay of the committed steps up to the
    checkpoint and after it, so weights and momentum came from the checkpoint."""
    lighthouse = _lighthouse()
    groups = [Group(i, 1, str(tmp_path)) for i in range(2)]
    args = ["--stop-file", str(tmp_path / "stop"), "--until-replicas", "2", "--sleep", "0.05", "--timeout", "5",
            "--ckpt", str(tmp_path / "ckpt"), "--save-every", "3", *SGD_ARGS]
    with _cleaned_up(groups, lighthouse):
        for g in groups:
            g.start(lighthouse.address(), args)
        # Both past a checkpoint, together (neither stops before the stop file is written).
        wait_for(lambda: all(any(r["replicas"] == 2 and r["step"] >= 4 for r in g.records()) for g in groups),
                 120, "both groups past step 4 together", groups)
        for g in groups:
            g.kill()
        first_life = {g.replica: g.records()[-1]["pid"] for g in groups}
        saved = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.endswith(".partial"))
        assert saved, "no checkpoint was saved before the kill"
        saved_step = int(saved[-1].split("_")[1])
        for g in groups:
            g.start(lighthouse.address(), [*args, "--init-seed", str(1 + g.replica)])
        wait_for(lambda: all(any(r["pid"] == g.procs[0].pid and r["replicas"] == 2 for r in g.records())
                             for g in groups), 120, "both groups back in a step together", groups)
        _stop_soon(tmp_path / "stop", [g.log(0) for g in groups])
        for g in groups:
            assert g.wait(120) == [0], g.output()
    firsts = []
    for g in groups:
        second = [r for r in g.records() if r["pid"] != first_life[g.replica]]
        assert second[0]["step"] > saved_step, (saved_step, second[:2])  # nothing before the checkpoint
        firsts.append(second[0]["step"])
    # The group up first resumed from the checkpoint (a later one may have been written between the
    # listing and the kill: at most one interval later); the other may have healed from it since.
    assert saved_step + 1 <= min(firsts) <= saved_step + 4, (saved_step, firsts)
    done = [_done(g, 0) for g in groups]
    assert done[0]["digest"] == done[1]["digest"], done
    # The committed history: the first lives' steps up to the one the second lives resumed at, then theirs.
    lives = [g.records() for g in groups]
    first_lives = [[r for r in records if r["pid"] == first_life[g.replica]] for g, records in zip(groups, lives)]
    second_lives = [[r for r in records if r["pid"] != first_life[g.replica]] for g, records in zip(groups, lives)]
    later = _committed(*second_lives)
    resumed_at = later[0]["step"] - 1
    earlier = [r for r in _committed(*first_lives) if r["step"] <= resumed_at]
    history = earlier + later
    _check_accounting(history, first_lives + second_lives)
    per_step, final = _replay(history)
    # A first life's steps after the checkpoint were lost with it: only the second lives' are checked there.
    kept = [[r for r in life if r["step"] <= resumed_at] for life in first_lives] + second_lives
    _check_against_reference(per_step, final, kept, [g.log(0) for g in groups])


def test_groups_that_start_together_from_other_weights_take_the_mean_from_the_first_step(tmp_path):
    """2 replica groups x 2 ranks seeded differently, in one quorum from step 0 (the lighthouse waits
    for both): before the first forward every group takes the first group's weights ([Note: the
    initial sync]), so every step, the first included, equals a plain replay from that group's seed
    in which the gradient is the mean of both groups' (losses, gradient norm, final parameters), and
    every shard rank ends bitwise equal across the groups."""
    lighthouse = _lighthouse(min_replicas=2)
    groups = [Group(i, 2, str(tmp_path)) for i in range(2)]
    with _cleaned_up(groups, lighthouse):
        for g in groups:
            g.start(lighthouse.address(), ["--steps", "4", "--min-replicas", "2", "--timeout", "10",
                                           "--init-seed", str(5 * g.replica), *SGD_ARGS])
        for g in groups:
            assert g.wait(120) == [0, 0], g.output()
    lives = [g.records() for g in groups]
    history = _committed(*lives)
    assert [r["step"] for r in history] == [1, 2, 3, 4] and all(r["replicas"] == 2 for r in history), history
    _check_accounting(history, lives)
    per_step, final = _replay(history)  # from seed 0: replica group 0's weights
    _check_against_reference(per_step, final, lives, [g.log(0) for g in groups])
    for rank in range(2):
        done = [_done(g, rank) for g in groups]
        assert all(d["compared"] == 2 for d in done) and done[0]["digest"] == done[1]["digest"], done


def test_too_few_replicas_stop_with_a_clear_error(tmp_path):
    """One replica group where two are required: no step commits, and after --max-failed-steps the
    job stops with a RuntimeError that says what was expected and how to resume."""
    lighthouse = _lighthouse()
    group = Group(0, 1, str(tmp_path))
    try:
        group.start(lighthouse.address(), ["--steps", "5", "--min-replicas", "2", "--max-failed-steps", "3",
                                           "--timeout", "5"])
        codes = group.wait(90)
    finally:
        group.kill()
        lighthouse.shutdown()
    assert codes[0] not in (0, None)
    out = group.output()
    assert "expected at least 2 live replica group(s)" in out and "3 steps in a row did not commit" in out, out
    assert "resumes from the last checkpoint" in out
    assert not any(r["committed"] for r in group.records())


def test_fault_tolerant_launch_is_one_job_per_node():
    from hybridshard.cli.launch import prepare

    opts, command = prepare(["--fault-tolerant", "--nnodes", "3", "--node-rank", "2", "--master-addr", "n0",
                             "--nproc-per-node", "2", "--max-restarts", "3", "train.py"])
    argv, env = list(command.argv), dict(command.env)
    assert argv[argv.index("--nnodes") + 1] == "1" and argv[argv.index("--rdzv-id") + 1] == "replica2"
    assert argv[argv.index("--rdzv-endpoint") + 1] == "127.0.0.1:0"
    assert argv[argv.index("--max-restarts") + 1] == "3"
    assert env["TORCHFT_LIGHTHOUSE"] == "http://n0:29510" and env["HYBRIDSHARD_REPLICA_ID"] == "replica2"
    assert opts.lighthouse_argv is None  # node 0 starts it
    opts, _ = prepare(["--fault-tolerant", "--nnodes", "3", "--node-rank", "0", "--master-addr", "n0",
                       "--nproc-per-node", "2", "train.py"])
    assert opts.lighthouse_argv[0].endswith("torchft_lighthouse") and "29510" in opts.lighthouse_argv[2]
    _, command = prepare(["--fault-tolerant", "--lighthouse", "lh:9", "--nnodes", "2", "--node-rank", "0",
                          "--master-addr", "n0", "--nproc-per-node", "1", "train.py"])
    assert dict(command.env)["TORCHFT_LIGHTHOUSE"] == "http://lh:9"


@pytest.mark.parametrize("argv, message", [
    (["--lighthouse", "lh:9", "--nproc-per-node", "1", "train.py"], "add --fault-tolerant"),
    (["--fault-tolerant", "--lighthouse", "lh", "--nproc-per-node", "1", "train.py"], "HOST:PORT"),
    (["--fault-tolerant", "--nnodes", "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", "n0:1",
      "--nproc-per-node", "1", "train.py"], "fixed node rank"),
])
def test_fault_tolerant_launch_errors(argv, message):
    from hybridshard.cli.launch import prepare

    with pytest.raises(ValueError, match=message):
        prepare(argv)


def test_local_cluster_host_fault_is_checked():
    from hybridshard.launcher.local_cluster import ClusterOptions, HostFault

    with pytest.raises(ValueError, match="regular expression"):
        HostFault(1, "(")
    with pytest.raises(ValueError, match="--kill-host must be 0..1"):
        ClusterOptions(num_nodes=2, procs_per_node=1, command=("true",), fault=HostFault(2, "x"))


@pytest.fixture
def one_rank_model(tmp_path, monkeypatch):
    """A one-rank job (its own store, on the port it bound) and a small HYBRID_SHARD model in it."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    import hybridshard as hs

    store = dist.TCPStore("127.0.0.1", 0, 1, is_master=True, wait_for_workers=False)  # bound once, port handed on
    for k, v in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port), "RANK": "0", "WORLD_SIZE": "1",
                 "HYBRIDSHARD_NODE_NAME": "node0"}.items():
        monkeypatch.setenv(k, v)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = hs.shard(nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2)), strategy="hybrid_shard",
                         groups=hs.init_groups(), wrap=lambda m: isinstance(m, nn.Linear))
        yield model, torch.optim.SGD(model.parameters(), lr=0.1)
    finally:
        dist.destroy_process_group()


def test_fault_tolerance_argument_errors(one_rank_model, monkeypatch, tmp_path):
    import torch

    import hybridshard as hs
    from hybridshard.ft.healing import load_shard_state, shard_state

    model, opt = one_rank_model
    with pytest.raises(ValueError, match="at least 1"):
        hs.FaultTolerance(model, opt, min_replicas=0, lighthouse="http://x:1", replica_id="r")
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    with pytest.raises(ValueError, match=r"the lighthouse's address.*TORCHFT_LIGHTHOUSE.*--fault-tolerant"):
        hs.FaultTolerance(model, opt, replica_id="r")
    monkeypatch.delenv("HYBRIDSHARD_REPLICA_ID", raising=False)
    with pytest.raises(ValueError, match="HYBRIDSHARD_REPLICA_ID"):
        hs.FaultTolerance(model, opt, lighthouse="http://x:1")
    import torch.nn as nn

    compressed = hs.shard(nn.Linear(4, 2), strategy="hybrid_shard", groups=hs.init_groups(),
                          replicate_compression="bf16")
    with pytest.raises(ValueError, match="replicate_compression='bf16'"):
        hs.FaultTolerance(compressed, opt, lighthouse="http://x:1", replica_id="r")
    state = shard_state(model, opt)
    state["units"] = state["units"][:1]
    with pytest.raises(ValueError, match="do not match this rank's"):
        load_shard_state(model, opt, state)

    lighthouse = _lighthouse()
    ft = hs.FaultTolerance(model, opt, lighthouse=lighthouse.address(), replica_id="r0", timeout=5)
    try:
        with pytest.raises(ValueError, match="already runs in fault-tolerant mode"):
            hs.FaultTolerance(model, opt, lighthouse=lighthouse.address(), replica_id="r1")
        with pytest.raises(ValueError, match="before start_step"):
            ft.step()
        with pytest.raises(ValueError, match="after the first start_step"):
            ft.check_replicas()
        # One step alone: it commits, counts the managed all-reduce, and the replica check compares 1 group.
        ft.start_step()
        model(torch.randn(3, 4)).sum().backward()
        assert ft.step() and ft.current_step == 1 and ft.num_replicas == 1
        assert hs.comm_stats(model)["groups"]["replicate"]["all_reduce"]["calls"] == 2
        assert ft.check_replicas() == 1
        hs.save_checkpoint(str(tmp_path / "plain"), model, optimizer=opt)
        with pytest.raises(ValueError, match="not saved by FaultTolerance.save_checkpoint"):
            ft.load_checkpoint(str(tmp_path / "plain"))
        assert ft.save_checkpoint(str(tmp_path / "ft"))
        assert ft.load_checkpoint(str(tmp_path / "ft")) is None and ft.current_step == 1
    finally:
        ft.shutdown()
        lighthouse.shutdown()


def test_planner_notes_fault_tolerance_for_hybrid_with_replicas():
    from hybridshard.estimates.sizing import ClusterSpec, ModelSpec, estimate
    from hybridshard.runtime.units.strategy import ShardingStrategy as S

    model = ModelSpec(num_params=2000, unit_params=1000)
    two_nodes = ClusterSpec(node_sizes=(4, 4), gpu_memory_bytes=10**6)
    hybrid = estimate(S.HYBRID_SHARD, 4, model=model, cluster=two_nodes)
    assert any("FaultTolerance" in n for n in hybrid.notes)
    one_node = estimate(S.HYBRID_SHARD, 4, model=model, cluster=ClusterSpec(node_sizes=(4,), gpu_memory_bytes=10**6))
    assert not any("FaultTolerance" in n for n in one_node.notes)


def test_fault_tolerant_launch_without_torchft_names_the_extra(monkeypatch, capsys):
    import argparse

    from hybridshard.cli import launch
    from hybridshard.launcher import ft

    monkeypatch.setattr(ft.shutil, "which", lambda *a, **k: None)
    argv = ["--fault-tolerant", "--nnodes", "2", "--node-rank", "0", "--master-addr", "n0", "--nproc-per-node", "1",
            "--dry-run", "train.py"]
    assert launch.run(argparse.Namespace(argv=argv, extra=[])) == 2
    assert "pip install hybridshard[ft]" in capsys.readouterr().err


def test_membership_says_one_line_per_change_from_one_group():
    """[Note: membership lines]: a loss is said by the group now first, a return by the group first before it."""
    from hybridshard.ft.membership import Membership

    m = Membership(speaks=False)
    said = [m.observe(committed=c, live=n, step=s, first=f, now=t) for c, n, s, f, t in [
        (True, 3, 10, True, 0.0), (False, 3, 10, True, 1.0), (False, 3, 10, True, 2.0), (True, 2, 11, True, 3.5),
        (True, 2, 12, True, 4.0), (True, 3, 40, True, 9.0), (True, 3, 41, True, 9.5)]]
    assert [s for s in said if s] == [
        "step 11: replica groups 3 -> 2 (1 lost); 2 steps retried, 2.5 s lost",
        "step 40: replica groups 2 -> 3 (1 back, healed from the live groups' state; it missed steps 11..39)"]
    # A group that is not first after the loss says nothing of it; a group that came back never speaks.
    quiet = Membership(speaks=False)
    assert quiet.observe(committed=True, live=3, step=1, first=False) is None
    assert quiet.observe(committed=True, live=2, step=2, first=False) is None
    back = Membership(speaks=False)
    assert back.observe(committed=True, live=3, step=40, first=True) is None
    assert back.observe(committed=True, live=3, step=41, first=True) is None
