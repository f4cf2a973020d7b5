"""`hybridshard launch`: argument splitting, option precedence, dry-run output, NUMA binding."""

import argparse
import dataclasses
import os
import subprocess
import sys

import pytest

from hybridshard.cli import launch as launch_cmd
from hybridshard.launcher import bind
from hybridshard.launcher.command import EntryMode, make_entry
from hybridshard.launcher.numa import compute_binding, format_cpulist, parse_cpulist
from hybridshard.launcher.settings import FRESH_STORE_ENV, LaunchOptions, Source, resolve_settings, slurm_port
from hybridshard.topology.nvml import FakeNvml
from hybridshard.topology.probe import probe_node, probe_rank
from hybridshard.topology.records import NumaNode

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures", "nvml")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SLURM = {"SLURM_JOB_ID": "777", "SLURM_NNODES": "2", "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]"}


def no_gpus():
    return probe_node(nvml=FakeNvml.from_file(os.path.join(FIXTURES, "no_nvml.json"))), ()


def four_gpus():
    return None, ("GPU-a", "GPU-b", "GPU-c", "GPU-d")


# -- argument splitting -------------------------------------------------------------------------

def test_split_ours_torchrun_and_program():
    s = launch_cmd.split_argv(["--nnodes", "2", "--max_restarts", "3", "--nproc_per_node=4", "--dry-run",
                               "--monitor-interval=1", "--redirects", "3", "train.py", "--lr", "1", "--nnodes", "9"])
    assert s.ours == ("--nnodes", "2", "--max-restarts", "3", "--nproc-per-node=4", "--dry-run")
    assert s.passthrough == ("--monitor-interval=1", "--redirects", "3")
    assert s.entry == ("train.py", "--lr", "1", "--nnodes", "9")  # the program's own options stay its own


def test_split_entry_flags_and_double_dash():
    s = launch_cmd.split_argv(["-m", "--no-python", "--", "--weird-name", "x"])
    assert (s.module, s.no_python, s.entry) == (True, True, ("--weird-name", "x"))


@pytest.mark.parametrize("argv, fragment", [
    (["--no-such-option", "x.py"], "unknown option '--no-such-option'"),
    (["--max-restarts"], "expects a value"),
    (["--standalone", "x.py"], "not supported"),
])
def test_split_errors(argv, fragment):
    with pytest.raises(ValueError, match=fragment):
        launch_cmd.split_argv(argv)


def test_make_entry(tmp_path):
    assert make_entry(["train.py", "--lr", "1"]) == make_entry(["python3", "train.py", "--lr", "1"])
    assert make_entry(["train.py"]).mode is EntryMode.SCRIPT
    e = make_entry([sys.executable, "-m", "hybridshard", "topo", "--cluster"])
    assert (e.mode, e.target, e.args) == (EntryMode.MODULE, "hybridshard", ("topo", "--cluster"))
    assert make_entry(["pkg.mod"], module=True).mode is EntryMode.MODULE
    assert make_entry(["/bin/echo", "hi"]).mode is EntryMode.EXEC
    assert make_entry(["python", "-c", "print(1)"]).mode is EntryMode.EXEC
    shebang = tmp_path / "tool"
    shebang.write_text("#!/usr/bin/env python3\nprint(1)\n")
    assert make_entry([str(shebang)]).mode is EntryMode.SCRIPT
    with pytest.raises(ValueError, match="not found"):
        make_entry(["no-such-program-anywhere"])
    with pytest.raises(ValueError, match="no program"):
        make_entry([])
    with pytest.raises(ValueError, match="contradict"):
        make_entry(["x"], module=True, no_python=True)


# -- settings precedence ------------------------------------------------------------------------

def test_slurm_fills_what_options_leave_out():
    s = resolve_settings(LaunchOptions(), SLURM, count_gpus=lambda: 4, slurm=True)
    assert (s.nnodes, s.node_rank, s.nproc_per_node, s.rdzv_host) == ("2", 1, "4", "gpu07")
    assert s.rdzv_port == slurm_port("777") and s.rdzv_backend == "static"
    assert s.source_of("nnodes") is Source.SLURM and s.source_of("nproc_per_node") is Source.GPUS
    s = resolve_settings(LaunchOptions(nnodes="4", node_rank=3, nproc_per_node="2", rdzv_endpoint="head:1234"),
                         SLURM, count_gpus=lambda: 8)
    assert (s.nnodes, s.node_rank, s.nproc_per_node, s.rdzv_host, s.rdzv_port) == ("4", 3, "2", "head", 1234)
    assert all(src is Source.OPTION for name, src in s.sources if name != "rdzv_backend" and name != "rdzv_id")


def test_defaults_without_slurm_or_gpus():
    s = resolve_settings(LaunchOptions(), {}, count_gpus=lambda: 0)
    assert (s.nnodes, s.node_rank, s.nproc_per_node) == ("1", 0, "1")
    assert s.rdzv_backend == "c10d" and s.rdzv_port == 0  # one node: a free local port
    s = resolve_settings(LaunchOptions(nnodes="2", node_rank=1, master_addr="10.0.0.1"), {}, count_gpus=lambda: 0)
    assert s.torchrun_args() == ["--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "1", "--rdzv-backend",
                                 "static", "--master-addr", "10.0.0.1", "--master-port", "29500"]


def test_c10d_backend_leaves_node_rank_to_the_rendezvous():
    s = resolve_settings(LaunchOptions(rdzv_backend="c10d", nnodes="1:4", rdzv_endpoint="head"), SLURM,
                         count_gpus=lambda: 1)
    args = s.torchrun_args()
    assert "--node-rank" not in args and "--rdzv-endpoint" in args and args[args.index("--rdzv-id") + 1] == "777"
    assert not s.node_rank_fixed


def test_restarts_use_c10d_and_a_new_store_per_attempt():
    # See [Note: restarts] in hybridshard/launcher/settings.py.
    s = resolve_settings(LaunchOptions(nnodes="2", node_rank=1, master_addr="h", master_port=7, max_restarts=2), {},
                         count_gpus=lambda: 0)
    assert s.rdzv_backend == "c10d" and s.source_of("rdzv_backend") is Source.RESTARTS and s.restartable
    assert s.torchrun_args() == ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
                                 "--rdzv-endpoint", "h:7", "--rdzv-id", "hybridshard", "--max-restarts", "2"]
    assert s.worker_env() == [FRESH_STORE_ENV]
    s = resolve_settings(LaunchOptions(nproc_per_node="2", max_restarts=1), {}, count_gpus=lambda: 0)
    assert (s.rdzv_backend, s.rdzv_port, s.worker_env()) == ("c10d", 0, [FRESH_STORE_ENV])  # one node too
    s = resolve_settings(LaunchOptions(nnodes="1:3", rdzv_backend="c10d", rdzv_endpoint="h"), {}, count_gpus=lambda: 0)
    assert s.worker_env() == [FRESH_STORE_ENV]  # membership changes restart the workers as well
    s = resolve_settings(LaunchOptions(nnodes="2", node_rank=0, master_addr="h", max_restarts=0), {},
                         count_gpus=lambda: 0)
    assert (s.rdzv_backend, s.restartable, s.worker_env()) == ("static", False, [])
    assert s.torchrun_args()[-2:] == ["--max-restarts", "0"]


def test_nccl_fault_defaults_fill_only_what_the_environment_lacks():
    # See [Note: NCCL faults] in hybridshard/launcher/settings.py.
    from hybridshard.launcher.command import build_command

    s = resolve_settings(LaunchOptions(nproc_per_node="2", max_restarts=1), {}, count_gpus=lambda: 0)
    cmd = build_command(s, make_entry(["train.py"]))
    env = cmd.environ({"PATH": "/bin", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"  # the user's value stays
    assert env["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1" and env["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "2000"
    assert env[FRESH_STORE_ENV[0]] == FRESH_STORE_ENV[1] and env["PATH"] == "/bin"
    shown = cmd.render({"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"})
    assert "inherited: TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in shown
    assert "unset (see [Note: NCCL faults]): TORCH_NCCL_DUMP_ON_TIMEOUT=1 TORCH_NCCL_TRACE_BUFFER_SIZE=2000" in shown


@pytest.mark.parametrize("options, fragment", [
    (LaunchOptions(nnodes="2"), "needs a rendezvous host"),
    (LaunchOptions(max_restarts=1, rdzv_backend="static"), "needs the c10d rendezvous, found --rdzv-backend static"),
    (LaunchOptions(max_restarts=-1), "0 or more, found -1"),
    (LaunchOptions(nnodes="2", node_rank=2, rdzv_endpoint="h"), "outside 0..1"),
    (LaunchOptions(nnodes="1:3", rdzv_endpoint="h"), "elastic"),
    (LaunchOptions(nnodes="zero"), "N or MIN:MAX"),
    (LaunchOptions(nnodes="3:1", rdzv_backend="c10d", rdzv_endpoint="h"), "not a valid count"),
    (LaunchOptions(rdzv_endpoint="h:99999"), "not 0..65535"),
    (LaunchOptions(rdzv_endpoint=":80"), "has no host"),
    (LaunchOptions(rdzv_endpoint="a:1", master_addr="b"), "disagree"),
    (LaunchOptions(master_port=70000, master_addr="a"), "not 0..65535"),
    (LaunchOptions(nproc_per_node="many"), "positive integer"),
])
def test_settings_errors(options, fragment):
    with pytest.raises(ValueError, match=fragment):
        resolve_settings(options, {}, count_gpus=lambda: 0)


# -- dry run --------------------------------------------------------------------------------------

def run_launch(argv, env, probe, capsys, monkeypatch):
    monkeypatch.setattr(launch_cmd, "_visible_gpus", probe)
    for k in list(os.environ):
        if k.startswith("SLURM_"):
            monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    rc = launch_cmd.run(argparse.Namespace(argv=argv, extra=[]))
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_dry_run_under_slurm(capsys, monkeypatch):
    rc, out, _ = run_launch(["--dry-run", "--max-restarts", "0", "train.py", "--steps", "3"], SLURM, four_gpus,
                            capsys, monkeypatch)
    assert rc == 0
    command = out.strip().splitlines()[-1]
    port = slurm_port("777")
    logs = os.path.join(os.getcwd(), "hybridshard-logs", "job777", "node1")
    assert command == (f"{sys.executable} -m hybridshard.launcher.agent --log-dir {logs} --redirects 3 "
                       f"--nnodes 2 --node-rank 1 --nproc-per-node 4 --rdzv-backend static --master-addr gpu07 "
                       f"--master-port {port} --max-restarts 0 train.py --steps 3")
    assert "nnodes=slurm" in out and "rdzv_host=slurm" in out and f"host gpu07 port {port}" in out


def test_dry_run_nproc_is_one_without_gpus_and_options_win(capsys, monkeypatch):
    rc, out, _ = run_launch(["--dry-run", "--nnodes", "3", "--node-rank", "0", "--rdzv-endpoint", "head:5000",
                             "python", "-m", "hybridshard", "topo"], SLURM, no_gpus, capsys, monkeypatch)
    assert rc == 0
    assert ("--nnodes 3 --node-rank 0 --nproc-per-node 1 --rdzv-backend static --master-addr head --master-port 5000 "
            "-m hybridshard topo") in out
    assert "nproc_per_node=default" in out


def test_dry_run_with_numa_binding(capsys, monkeypatch):
    node = dgx_node()
    uuids = tuple(g.uuid for g in node.gpus)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(224)))
    rc, out, _ = run_launch(["--dry-run", "--bind-numa", "--nproc-per-node", "8", "t.py"], {},
                            lambda: (node, uuids), capsys, monkeypatch)
    assert rc == 0
    last = out.strip().splitlines()[-1]
    binding = "0-55,112-167;" * 4 + "56-111,168-223;" * 3 + "56-111,168-223"
    assert last.startswith(f"env 'HYBRIDSHARD_CPU_BINDING={binding}' ")
    assert "-m hybridshard.launcher.bind script t.py" in last
    assert "local rank 4: GPU 4 -> CPUs 56-111" in out


def test_dry_run_with_restarts(capsys, monkeypatch):
    rc, out, err = run_launch(["--dry-run", "--nnodes", "2", "--node-rank", "1", "--master-addr", "head",
                               "--max-restarts", "3", "t.py"], {}, no_gpus, capsys, monkeypatch)
    assert rc == 0
    assert out.strip().splitlines()[-1].startswith("env TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 ")
    assert "--rdzv-backend c10d --rdzv-endpoint head:29500 --rdzv-id hybridshard --max-restarts 3 t.py" in out
    assert "rdzv_backend=max-restarts" in out and "# restarts: up to 3 per node" in out


def test_launch_errors_exit_2(capsys, monkeypatch):
    rc, _, err = run_launch(["--nnodes", "2", "t.py"], {}, no_gpus, capsys, monkeypatch)
    assert rc == 2 and "needs a rendezvous host" in err
    rc, _, err = run_launch(["--bind-numa", "t.py"], {}, no_gpus, capsys, monkeypatch)
    assert rc == 2 and "needs GPUs" in err
    rc, _, err = run_launch(["--bogus"], {}, no_gpus, capsys, monkeypatch)
    assert rc == 2 and "unknown option" in err
    rc, out, _ = run_launch([], {}, no_gpus, capsys, monkeypatch)
    assert rc == 2 and "usage" in out


def test_cli_dry_run_in_a_subprocess():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_") and k != "CUDA_VISIBLE_DEVICES"}
    env.update(SLURM, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-m", "hybridshard", "launch", "--dry-run", "train.py"], env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert "--nnodes 2 --node-rank 1 --nproc-per-node 1" in done.stdout  # no GPUs on this machine: 1
    assert "--master-addr gpu07" in done.stdout


def test_real_launch_runs_torchrun(tmp_path):
    script = tmp_path / "w.py"
    script.write_text("import os\nopen(os.path.join(os.path.dirname(__file__), 'r' + os.environ['RANK']), 'w')"
                      ".write(os.environ['WORLD_SIZE'] + ' ' + os.environ['LOCAL_RANK'])\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(PYTHONPATH=REPO, OMP_NUM_THREADS="1")
    done = subprocess.run([sys.executable, "-m", "hybridshard", "launch", "--nproc-per-node", "2", str(script)],
                          env=env, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert sorted(p.read_text() for p in tmp_path.glob("r*")) == ["2 0", "2 1"]
    assert len(list(tmp_path.glob("hybridshard-logs/run-*/node0/*/attempt_0/[01]/stdout.log"))) == 2


# -- NUMA binding ---------------------------------------------------------------------------------

def dgx_node():
    node = probe_node(nvml=FakeNvml.from_file(os.path.join(FIXTURES, "dgx_h100_nvswitch.json")))
    # Two sockets of 56 cores with hyper-threads, as on a DGX H100.
    numa = (NumaNode(0, tuple(range(0, 56)) + tuple(range(112, 168))),
            NumaNode(1, tuple(range(56, 112)) + tuple(range(168, 224))))
    return dataclasses.replace(node, numa_nodes=numa)


def test_binding_follows_the_gpus_numa_node():
    node = dgx_node()
    b = compute_binding(node, [g.uuid for g in node.gpus], 8)
    assert b.gpu_per_local_rank == tuple(range(8)) and b.numa_per_local_rank == (0,) * 4 + (1,) * 4
    assert b.cpus_for(0) == node.numa_nodes[0].cpus and b.cpus_for(7) == node.numa_nodes[1].cpus
    assert format_cpulist(b.cpus_for(5)) == "56-111,168-223"


def test_binding_respects_visible_order_and_allowed_cpus():
    node = probe_node(nvml=FakeNvml.from_file(os.path.join(FIXTURES, "pcie_nvlink_pairs.json")))
    node = dataclasses.replace(node, numa_nodes=())
    rp = probe_rank(rank=0, local_rank=0, world_size=1, env={"CUDA_VISIBLE_DEVICES": "6,2"},
                    nvml=FakeNvml.from_file(os.path.join(FIXTURES, "pcie_nvlink_pairs.json")))
    # No NUMA table: the GPUs' NVML affinity masks are used.
    b = compute_binding(node, rp.visible_gpu_uuids, 2)
    assert b.gpu_per_local_rank == (6, 2)
    assert b.cpus_for(0) == node.gpus[6].cpu_affinity and b.cpus_for(1) == node.gpus[2].cpu_affinity
    b = compute_binding(node, rp.visible_gpu_uuids, 3, allowed_cpus=range(0, 40))
    assert b.numa_per_local_rank == (None, None, None)
    assert set(b.cpus_for(0)) == set(node.gpus[6].cpu_affinity) & set(range(40))
    assert b.cpus_for(2) == b.cpus_for(0)  # local rank 2 shares visible GPU 0 (2 % 2)


def test_binding_errors():
    node = dgx_node()
    uuids = [g.uuid for g in node.gpus]
    empty = probe_node(nvml=FakeNvml.from_file(os.path.join(FIXTURES, "no_nvml.json")))
    with pytest.raises(ValueError, match="needs GPUs.*NVML"):
        compute_binding(empty, [], 1)
    with pytest.raises(ValueError, match="outside the CPUs this job may use"):
        compute_binding(node, uuids, 8, allowed_cpus={0, 1})
    with pytest.raises(ValueError, match=">= 1"):
        compute_binding(node, uuids, 0)
    with pytest.raises(ValueError, match="check CUDA_VISIBLE_DEVICES"):
        compute_binding(node, ["GPU-not-here"], 1)
    bare = dataclasses.replace(node, numa_nodes=(), gpus=tuple(dataclasses.replace(g, cpu_affinity=()) for g in node.gpus))
    with pytest.raises(ValueError, match="neither a NUMA node"):
        compute_binding(bare, uuids, 1)
    with pytest.raises(ValueError, match="LOCAL_RANK 9"):
        compute_binding(node, uuids, 2).cpus_for(9)


def test_cpulist_round_trip_and_errors():
    assert format_cpulist([5, 0, 1, 2, 7, 8]) == "0-2,5,7-8"
    assert parse_cpulist("0-2,5,7-8") == (0, 1, 2, 5, 7, 8)
    for bad, fragment in (("3-1", "backwards"), ("a", "not N"), ("", "names no CPU")):
        with pytest.raises(ValueError, match=fragment):
            parse_cpulist(bad)


def test_bind_wrapper_pins_the_worker():
    cpu = min(os.sched_getaffinity(0))
    env = dict(os.environ, PYTHONPATH=REPO, LOCAL_RANK="1", HYBRIDSHARD_CPU_BINDING=f"0-1;{cpu}")
    done = subprocess.run([sys.executable, "-m", "hybridshard.launcher.bind", "exec", sys.executable, "-c",
                           "import os; print(sorted(os.sched_getaffinity(0)))"],
                          env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"[{cpu}]"


def test_bind_wrapper_errors():
    with pytest.raises(RuntimeError, match="not set"):
        bind.cpus_for_this_rank({"LOCAL_RANK": "0"})
    with pytest.raises(RuntimeError, match="under torchrun"):
        bind.cpus_for_this_rank({"HYBRIDSHARD_CPU_BINDING": "0"})
    with pytest.raises(ValueError, match="has 1 CPU sets but LOCAL_RANK is 3"):
        bind.cpus_for_this_rank({"HYBRIDSHARD_CPU_BINDING": "0", "LOCAL_RANK": "3"})
    with pytest.raises(ValueError, match="bind mode"):
        bind.exec_argv("shell", "x", [])


@pytest.mark.parametrize("argv, fragment", [
    (["--bind-numa", "--nproc-per-node", "auto", "t.py"], "needs a numeric --nproc-per-node, found 'auto'"),
    (["--bind-numa", "--run-path", "t.py"], "cannot be combined with --run-path"),
])
def test_bind_numa_errors_exit_2(argv, fragment, capsys, monkeypatch):
    rc, _, err = run_launch(argv, {}, four_gpus, capsys, monkeypatch)
    assert rc == 2 and fragment in err
