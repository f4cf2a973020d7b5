"""The package layout keeps its promises (docs/architecture.md): small modules, one concept each,
re-exports only at the top, no private names imported across packages, and one groups type whose
``None`` means "no group" everywhere."""

from __future__ import annotations

import ast
import pathlib

import pytest
import torch

import hybridshard as hs

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGE_DIRS = {"hybridshard": ROOT / "hybridshard", "hybridshard.topology": ROOT / "topology"}
MAX_LINES = 420  # "modules under ~400 lines"


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for prefix, folder in PACKAGE_DIRS.items():
        for path in folder.rglob("*.py"):
            if "__pycache__" in path.parts:
                continue
            parts = path.relative_to(folder).with_suffix("").parts
            if prefix == "hybridshard" and parts and parts[0] == "topology":
                continue
            out[".".join((prefix, *parts))] = path
    return out


def _package_of(module: str) -> str:
    """``hybridshard.runtime.units.unit`` -> ``hybridshard.runtime``; top-level modules -> ``hybridshard``."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 or module.endswith("__init__") else parts[0]


def test_modules_are_small():
    sizes = {name: len(path.read_text().splitlines()) for name, path in _modules().items()}
    too_big = {name: n for name, n in sizes.items() if n > MAX_LINES}
    assert not too_big, f"modules over {MAX_LINES} lines: {too_big}; split them by concept"


def test_top_level_init_only_re_exports():
    tree = ast.parse((ROOT / "hybridshard" / "__init__.py").read_text())
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):  # the docstring
            continue
        if isinstance(node, ast.Assign) and all(isinstance(t, ast.Name) for t in node.targets):
            assert {t.id for t in node.targets} <= {"__all__", "__version__"}, ast.dump(node)
            continue
        pytest.fail(f"hybridshard/__init__.py line {node.lineno}: {type(node).__name__} is not a re-export")


def test_no_private_name_is_imported_across_packages():
    found = []
    for name, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith("hybridshard"):
                continue
            if _package_of(node.module) == _package_of(name):
                continue
            private = [a.name for a in node.names if a.name.startswith("_")]
            if private:
                found.append(f"{name} imports {private} from {node.module}")
    assert not found, found


def test_no_module_shadows_a_public_function():
    clashes = [n for n in hs.__all__ if f"hybridshard.{n}" in _modules()]
    assert not clashes, f"hybridshard.<name> is both a function and a module: {clashes}"


def test_every_public_name_resolves():
    for name in hs.__all__:
        assert getattr(hs, name) is not None, name


@pytest.fixture()
def one_rank_job(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_none_means_no_group(one_rank_job):
    import torch.distributed as dist

    from hybridshard.runtime.comm import collectives as C
    from hybridshard.topology.groups import ShardGroups, group_name

    nothing = ShardGroups(shard=None, replicate=None)
    assert (nothing.shard_size, nothing.replicate_size, nothing.shard_rank, nothing.replicate_rank) == (1, 1, 0, 0)
    assert C.group_size(None) == 1 and group_name(None) == "none"
    sharded, replicated = ShardGroups.over_world(), ShardGroups.over_world(replicate=True)
    assert sharded.shard is dist.group.WORLD and sharded.replicate is None
    assert replicated.shard is None and replicated.replicate is dist.group.WORLD
    # None copies locally and counts nothing; the world is a real (counted) collective.
    with hs.count_collectives() as counts:
        out = torch.empty(4)
        C.all_gather(out, torch.arange(4.0), None)
        assert torch.equal(out, torch.arange(4.0))
        C.all_reduce(torch.ones(3), None)
        C.broadcast(torch.ones(3), 0, None)
    assert sum(counts.calls.values()) == 0
    with pytest.raises(AssertionError, match="no group means no communication"):
        C._run("all_reduce", None, torch.ones(1), lambda a: None)
