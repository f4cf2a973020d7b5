"""What `pip install` puts on sys.path: only `hybridshard`, never a top-level `topology`.

A top-level `topology` would collide with the PyPI project of that name (a network-testing
framework), so the repository's `topology/` folder installs as `hybridshard.topology`.
"""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _sources(folder: pathlib.Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*.py") if "__pycache__" not in p.parts}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> zipfile.ZipFile:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out), str(ROOT)],
        capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    (path,) = out.glob("hybridshard-*.whl")
    return zipfile.ZipFile(path)


def test_wheel_installs_only_the_hybridshard_top_level_name(wheel):
    names = wheel.namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}
    assert top == {"hybridshard"}, f"the wheel installs top-level names {sorted(top)}"
    top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
    if top_level:
        assert wheel.read(top_level[0]).decode().split() == ["hybridshard"]


def test_wheel_carries_every_source_file(wheel):
    names = set(wheel.namelist())
    for folder, prefix in ((ROOT / "topology", "hybridshard/topology/"), (ROOT / "hybridshard", "hybridshard/")):
        missing = sorted(prefix + f for f in _sources(folder) if prefix + f not in names)
        assert not missing, f"not in the wheel (add the package to pyproject.toml's packages list): {missing}"


def test_no_code_imports_the_old_top_level_name():
    pattern = re.compile(r"^\s*(from|import)\s+topology\b", re.M)
    offenders = []
    for folder in ("hybridshard", "topology", "tests", "benchmarks", "examples"):
        for path in (ROOT / folder).rglob("*.py"):
            if pattern.search(path.read_text()):
                offenders.append(str(path.relative_to(ROOT)))
    assert not offenders, f"import `hybridshard.topology`, not `topology`: {offenders}"
