"""SLURM variables and compressed node lists."""

import pytest

from hybridshard.launcher.slurm import SlurmEnv, expand_nodelist, parse_nodelist, slurm_from_env

NO_SCONTROL = None  # the built-in parser only, whatever this machine has installed


@pytest.mark.parametrize("text, hosts", [
    ("gpu07", ("gpu07",)),
    ("gpu[07-09,12]", ("gpu07", "gpu08", "gpu09", "gpu12")),
    ("a[1-2],b3", ("a1", "a2", "b3")),
    ("n[8-11]", ("n8", "n9", "n10", "n11")),
    ("n[098-101]", ("n098", "n099", "n100", "n101")),
    ("rack[1-2]-n[01-02]", ("rack1-n01", "rack1-n02", "rack2-n01", "rack2-n02")),
    ("x[3],y[1-2].ib", ("x3", "y1.ib", "y2.ib")),
    (" h1 , h2 ", ("h1", "h2")),
])
def test_parse_nodelist(text, hosts):
    assert parse_nodelist(text) == hosts


@pytest.mark.parametrize("text, fragment", [
    ("", "empty"),
    ("gpu[01-04", "never closed"),
    ("gpu01]", "without"),
    ("gpu[[1]]", "nested"),
    ("gpu[04-01]", "backwards"),
    ("gpu[a-b]", "bad range"),
    ("gpu[]", "bad range"),
    ("a,,b", "empty entry"),
])
def test_parse_nodelist_errors(text, fragment):
    with pytest.raises(ValueError, match=fragment):
        parse_nodelist(text)


def test_expand_prefers_scontrol_and_falls_back():
    calls = []

    def fake_scontrol(text):
        calls.append(text)
        return ("from-scontrol1", "from-scontrol2")

    assert expand_nodelist("n[1-2]", scontrol=fake_scontrol) == ("from-scontrol1", "from-scontrol2")
    assert calls == ["n[1-2]"]
    assert expand_nodelist("n[1-2]", scontrol=lambda text: None) == ("n1", "n2")


def _env(**kw):
    base = {"SLURM_JOB_ID": "4242", "SLURM_NNODES": "3", "SLURM_NODEID": "2", "SLURM_JOB_NODELIST": "gpu[07-08],cpu1"}
    base.update(kw)
    return {k: v for k, v in base.items() if v is not None}


def test_slurm_from_env():
    job = slurm_from_env(_env(), scontrol=NO_SCONTROL)
    assert job == SlurmEnv(job_id="4242", num_nodes=3, node_id=2, hosts=("gpu07", "gpu08", "cpu1"))
    assert job.first_host == "gpu07"
    # SLURM_JOB_NUM_NODES is the newer spelling of SLURM_NNODES.
    job = slurm_from_env(_env(SLURM_NNODES=None, SLURM_JOB_NUM_NODES="3"), scontrol=NO_SCONTROL)
    assert job.num_nodes == 3


def test_outside_slurm():
    assert slurm_from_env({"SLURM_NNODES": "2"}, scontrol=NO_SCONTROL) is None


@pytest.mark.parametrize("env, fragment", [
    (_env(SLURM_NODEID=None), "SLURM_NODEID"),
    (_env(SLURM_JOB_NODELIST=None), "SLURM_JOB_NODELIST"),
    (_env(SLURM_NNODES="two"), "must be an integer"),
    (_env(SLURM_NODEID="3"), "outside 0..2"),
    (_env(SLURM_NNODES="2", SLURM_NODEID="1"), "expands to 3 hosts"),
    (_env(SLURM_NNODES="0", SLURM_NODEID="0"), ">= 1"),
])
def test_slurm_env_errors(env, fragment):
    with pytest.raises(ValueError, match=fragment):
        slurm_from_env(env, scontrol=NO_SCONTROL)


def test_sbatch_script_gives_srun_the_jobs_cpus(tmp_path):
    # A stand-in srun that prints its argv: the step must ask for the job's CPUs per task explicitly.
    import os
    import subprocess
    from pathlib import Path

    srun = tmp_path / "srun"
    srun.write_text('#!/bin/sh\nfor a in "$@"; do echo "$a"; done\n')
    srun.chmod(0o755)
    script = Path(__file__).resolve().parents[1] / "launch" / "slurm.sbatch"
    env = {**os.environ, "PATH": f"{tmp_path}{os.pathsep}{os.environ['PATH']}", "SLURM_CPUS_PER_TASK": "64"}
    args = subprocess.run(["bash", str(script), "train.py", "--steps", "3"], env=env, capture_output=True,
                          text=True, timeout=30, check=True).stdout.splitlines()
    assert "--cpus-per-task=64" in args and args[-4:] == ["--", "train.py", "--steps", "3"]
    env.pop("SLURM_CPUS_PER_TASK")
    args = subprocess.run(["bash", str(script), "train.py"], env=env, capture_output=True, text=True, timeout=30,
                          check=True).stdout.splitlines()
    assert not any(a.startswith("--cpus-per-task") for a in args) and args[-2:] == ["--", "train.py"]
