"""Loading or inspecting a checkpoint never runs code from it (see [Note: checkpoints are data] in
hybridshard/state/trust.py).

Tampered copies of real checkpoints (tests/untrusted_jobs.py: pickled ``os.system("touch marker")``
in ``.metadata``, in ``extra``, in ``optim.param_groups``, in an optimizer entry, in place of
``hybridshard.json``) go through ``hybridshard ckpt inspect``, ``read_extra``, ``load_checkpoint``
(one process, and 2 simulated nodes x 2 ranks) and the Hugging Face and Lightning resumes: each
refuses on its first line, the marker never appears, and the weights stay as they were. The same
payload does run when the caller says the checkpoint is trusted, so the refusals are not vacuous.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import pickle
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

import hybridshard as hs
from hybridshard.cli import main
from hybridshard.state import checkpoint as CK
from hybridshard.state.trust import TRUST_ENV, check_plain
from tests import runtime_models as RM
from tests import untrusted_jobs as U
from tests.mp import RankPool

REFUSED = "refused checkpoint "
NOTHING_RAN = "nothing from it was executed and nothing was changed (model and optimizer untouched)"
FIXTURE = os.path.join(os.path.dirname(__file__), "fixtures", "checkpoint-v1")
"""A checkpoint written by hybridshard before checkpoints were read as data (RM.make_model(7), AdamW, extra)."""


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = RM.make_model(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    tokens = RM.batch(0, 0, 0, 2)
    RM.lm_loss(model(tokens), tokens).backward()
    opt.step()
    return model, opt


@pytest.fixture(scope="module")
def tampered(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tampered")
    model, opt = _trained(0)
    good = str(root / "good")
    hs.save_checkpoint(good, model, optimizer=opt, extra={"step": 1, "loader": [3, 4]})
    marker = str(root / "MARKER")
    paths = {kind: U.tamper(good, str(root / kind), kind, marker) for kind in U.KINDS}
    return {"good": good, "marker": marker, **paths}


def _expect_refusal(line: str, path: str, where: str) -> None:
    assert line.startswith(f"UnsafeCheckpointError: {REFUSED}{path}: {where}"), line
    assert "tries to load posix.system" in line and NOTHING_RAN in line and f"{TRUST_ENV}=1" in line, line


WHERE = {"metadata": ".metadata (DCP's metadata)", "extra": "__0_0.distcp, entry 'extra',",
         "param_groups": "__0_0.distcp, entry 'optim.param_groups',",
         "optim_step": "__0_0.distcp, entry 'optim.state.",}


def test_one_process_refuses_every_tampering(tampered, capsys):
    marker = tampered["marker"]
    for kind in U.KINDS:
        path = tampered[kind]
        model, opt = _trained(1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optim_before = {k: v.clone() for k, v in opt.state[model.embed.weight].items()}
        load = U.first_line(lambda: hs.load_checkpoint(path, model, optimizer=opt))
        extra = U.first_line(lambda: CK.read_extra(path))
        code = main(["ckpt", "inspect", path])
        err = capsys.readouterr().err.strip().splitlines()
        assert code == 1 and len(err) == 1 and err[0].startswith("hybridshard ckpt inspect: error: "), (kind, err)
        inspect = "UnsafeCheckpointError: " + err[0].removeprefix("hybridshard ckpt inspect: error: ")
        if kind == "manifest":  # parsed as JSON, never unpickled: a damaged file (read_extra does not read it)
            for line in (load, "ValueError: " + inspect.split(": ", 1)[1]):
                assert line.startswith(f"ValueError: checkpoint {path}: hybridshard.json is not JSON"), line
            assert extra == "returned", extra
        else:
            _expect_refusal(load, path, WHERE[kind])
            _expect_refusal(inspect, path, WHERE[kind])
            if kind in ("metadata", "extra"):
                _expect_refusal(extra, path, WHERE[kind])
            else:
                assert extra == "returned", extra  # read_extra reads only the extra
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items()), kind
        assert all(torch.equal(v, optim_before[k]) for k, v in opt.state[model.embed.weight].items()), kind
        assert not os.path.exists(marker), kind
    # As the report that found it: the whole .metadata replaced by the payload.
    whole = U.tamper(tampered["good"], tampered["good"] + "-whole", "extra", marker)
    with open(os.path.join(whole, ".metadata"), "wb") as f:
        pickle.dump(U.Payload(marker), f)
    assert main(["ckpt", "inspect", whole]) == 1
    _expect_refusal("UnsafeCheckpointError: " + capsys.readouterr().err.split("error: ", 1)[1].strip(), whole, WHERE["metadata"])
    _expect_refusal(U.first_line(lambda: hs.load_checkpoint(whole, RM.make_model(1))), whole, WHERE["metadata"])
    assert not os.path.exists(marker)
    # The untampered original still loads, and inspect shows its extra.
    model, opt = _trained(1)
    assert hs.load_checkpoint(tampered["good"], model, optimizer=opt) == {"step": 1, "loader": [3, 4]}
    assert main(["ckpt", "inspect", tampered["good"]]) == 0
    assert "extra      {'step': 1, 'loader': [3, 4]}" in capsys.readouterr().out


def test_inspect_is_one_error_line_and_the_escape_hatch_runs_the_payload(tampered, tmp_path):
    """As a user runs it: exit 1, one line on stderr, no traceback. With the escape hatch the same
    payload runs, so the refusals above guard against a live one."""
    cmd = [sys.executable, "-m", "hybridshard", "ckpt", "inspect"]
    env = {k: v for k, v in os.environ.items() if k != TRUST_ENV}
    for kind in ("metadata", "extra"):
        done = subprocess.run([*cmd, tampered[kind]], capture_output=True, text=True, timeout=120, env=env)
        assert done.returncode == 1 and done.stdout == "", done
        lines = done.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in done.stderr, done.stderr
        assert lines[0].startswith(f"hybridshard ckpt inspect: error: {REFUSED}{tampered[kind]}: {WHERE[kind]}"), lines
    assert not os.path.exists(tampered["marker"])

    marker = str(tmp_path / "RAN")
    path = U.tamper(tampered["good"], str(tmp_path / "extra"), "extra", marker)
    CK.read_extra(path, trusted=True)
    assert os.path.exists(marker)  # the payload is real
    os.remove(marker)
    path = U.tamper(tampered["good"], str(tmp_path / "md"), "metadata", marker)
    subprocess.run([*cmd, path], capture_output=True, timeout=120, env={**env, TRUST_ENV: "1"})
    assert os.path.exists(marker)


def test_paths_and_sizes_from_the_metadata_are_checked_first(tampered, tmp_path):
    import shutil

    def edited(name: str, change) -> str:
        dst = str(tmp_path / name)
        shutil.copytree(tampered["good"], dst)
        with open(os.path.join(dst, ".metadata"), "rb") as f:
            md = pickle.load(f)
        change(md)
        with open(os.path.join(dst, ".metadata"), "wb") as f:
            pickle.dump(md, f)
        return dst

    def entry(md, fqn):
        return next(i for i in md.storage_data if i.fqn == fqn)

    secret = tmp_path / "secret.bin"
    secret.write_bytes(b"x" * 4096)
    outside = edited("outside", lambda md: setattr(md.storage_data[entry(md, "extra")], "relative_path", "../secret.bin"))
    past_end = edited("past_end", lambda md: setattr(md.storage_data[entry(md, "extra")], "offset", 10**9))
    chunk = edited("chunk", lambda md: setattr(md.state_dict_metadata["model.pos"].chunks[0], "sizes", torch.Size([99, 16])))
    def grow(md):  # a per-element optimizer entry that is not its parameter's shape
        entry = md.state_dict_metadata["optim.state.pos.exp_avg"]
        entry.size = entry.chunks[0].sizes = torch.Size([7, 16])

    def truncate(md):  # a tensor chunk whose stored bytes cannot hold it
        md.storage_data[entry(md, "model.pos")].length = 100

    wrong_size = edited("wrong_size", grow)
    short = edited("short", truncate)
    cases = {  # path: (the first line or, after "... failed on rank 0: ", its rest; whether read_extra and inspect see it)
        outside: ("UnsafeCheckpointError: refused checkpoint {p}: entry 'extra' is stored in '../secret.bin', which is "
                  "outside the checkpoint directory", True),
        past_end: ("ValueError: checkpoint {p}: entry 'extra' lies at bytes [1000000000,", True),
        chunk: ("ValueError: checkpoint {p}: .metadata is malformed (entry 'model.pos' of size [6, 16] has a chunk", True),
        short: ("ValueError: checkpoint {p}: .metadata is malformed (entry 'model.pos' at [0, 0]: 100 bytes stored, "
                "384 needed)", True),
        wrong_size: ("ValueError: checkpoint {p}: optimizer entry 'optim.state.pos.exp_avg' has size [7, 16], its "
                     "parameter [6, 16]", False),
    }
    for path, (expected, everywhere) in cases.items():
        model, opt = _trained(1)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        expected = expected.format(p=path)
        if "failed on rank" in (line := U.first_line(lambda: hs.load_checkpoint(path, model, optimizer=opt))):
            expected = expected.replace("ValueError: ", f"ValueError: load_checkpoint({path}) failed on rank 0: ")
        assert line.startswith(expected), line
        assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
        if everywhere:
            line = U.first_line(lambda: CK.read_extra(path))
            assert line.startswith(expected.replace("load_checkpoint", "read_extra")), line
            assert main(["ckpt", "inspect", path]) == 1


def test_saving_a_non_plain_extra_fails_naming_the_key_path(tmp_path):
    model = RM.make_model(0)
    path = tmp_path / "ck"
    cases = {
        "extra['args']": {"step": 1, "args": argparse.Namespace(lr=0.1)},
        "extra['hp']['dir']": {"hp": {"dir": pathlib.Path("/data")}},
        "extra['loss'][1]": {"loss": [1.0, np.float32(2.0)]},
        "extra['fn']": {"fn": lambda x: x},
    }
    for key, extra in cases.items():
        with pytest.raises(ValueError) as info:
            hs.save_checkpoint(path, model, extra=extra)
        line = str(info.value).splitlines()[0]
        assert line.startswith(f"{key} is of type "), line
        assert not os.path.exists(path) and not os.path.exists(f"{path}.partial")  # not a byte written
    with pytest.raises(ValueError, match=r"^optim.param_groups\[0\]\['note'\] is of type argparse.Namespace"):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        opt.param_groups[0]["note"] = argparse.Namespace()
        hs.save_checkpoint(path, model, optimizer=opt)
    assert not os.path.exists(path)


def test_trainer_states_are_made_plain():
    from lightning.fabric.utilities.data import AttributeDict

    from hybridshard.integrations.common import plain_values

    state = {"hyper_parameters": AttributeDict(lr=0.1, args=argparse.Namespace(root=pathlib.Path("/d"))),
             "hparams_type": AttributeDict, "best": np.float64(0.5), "ids": np.arange(3), "epoch": 2,
             "score": torch.tensor(1.0)}
    plain, converted = plain_values(state, "checkpoint")
    assert plain["hyper_parameters"] == {"lr": 0.1, "args": {"root": "/d"}}
    assert type(plain["hyper_parameters"]) is dict and type(plain["best"]) is float
    assert torch.equal(plain["ids"], torch.arange(3)) and plain["epoch"] == 2 and plain["score"] is state["score"]
    assert plain["hparams_type"] == "lightning.fabric.utilities.data.AttributeDict"
    assert converted == [
        "checkpoint['hyper_parameters'] (lightning.fabric.utilities.data.AttributeDict)",
        "checkpoint['hyper_parameters']['args'] (argparse.Namespace)",
        "checkpoint['hyper_parameters']['args']['root'] (pathlib.PosixPath)",
        "checkpoint['hparams_type'] (builtins.type)",
        "checkpoint['best'] (numpy.float64)",
        "checkpoint['ids'] (numpy.ndarray)",
    ], converted
    check_plain(plain, "checkpoint")


def test_a_checkpoint_written_before_still_loads():
    """tests/fixtures/checkpoint-v1 was written by the code before this change; it loads as it did
    through plain DCP (full pickle), the reference here."""
    model, opt = _trained(3)
    assert hs.load_checkpoint(FIXTURE, model, optimizer=opt) == {"step": 5, "note": "v1"}
    reference = {k: torch.empty_like(v) for k, v in RM.make_model(0).state_dict().items() if k != "head.weight"}
    dcp.load({"model": reference}, storage_reader=dcp.FileSystemReader(FIXTURE), no_dist=True)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in reference.items())
    assert opt.state[model.embed.weight]["exp_avg"].abs().sum() > 0


@pytest.mark.multiprocess
def test_tampered_checkpoints_through_every_sharded_reader(tmp_path):
    """One pool: load_checkpoint on 2 nodes x 2 ranks, then the Hugging Face and Lightning resumes."""
    marker = str(tmp_path / "MARKER")
    with RankPool(4, num_nodes=2, layout="block") as pool:
        loads = pool.run(U.load_tampered, str(tmp_path / "dcp"), marker)
        hf = pool.run(U.hf_resume_tampered, str(tmp_path / "hf"), marker)
        lit = pool.run(U.lightning_resume_tampered, str(tmp_path / "lightning"), marker)
    assert not os.path.exists(marker)
    for rank, got in enumerate(loads):
        for kind in U.KINDS:
            path = str(tmp_path / "dcp" / f"tampered-{kind}")
            if kind == "manifest":
                assert got[kind].startswith(f"ValueError: checkpoint {path}: hybridshard.json is not JSON"), got[kind]
            else:
                assert got[kind].startswith(f"UnsafeCheckpointError: {REFUSED}{path}: "), (rank, got[kind])
                assert "tries to load posix.system" in got[kind] and NOTHING_RAN in got[kind]
            assert got[f"{kind} unchanged"], (rank, kind)
        assert got["good"] == {"step": 1} and got["good loaded"], rank
    for name, results, kinds in (("hf", hf, ("metadata", "param_groups", "optim_step")),
                                 ("lightning", lit, ("metadata", "extra", "param_groups"))):
        for rank, got in enumerate(results):
            for kind in kinds:
                assert got[kind].startswith(f"UnsafeCheckpointError: {REFUSED}"), (name, rank, kind, got[kind])
                assert "tries to load posix.system" in got[kind] and NOTHING_RAN in got[kind], got[kind]
                assert got[f"{kind} unchanged"], (name, rank, kind)
    saved = lit[0]["saved extra"]  # Lightning's state went in, made plain
    assert "loops" in saved and saved["hyper_parameters"] == {
        "seed": 0, "data": str(tmp_path / "lightning"), "args": {"lr": 1e-2}}, saved["hyper_parameters"]
