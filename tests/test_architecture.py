"""The package layout keeps its promises (docs/architecture.md): packages and the runtime's layers
import only downwards (a back-reference upwards only under ``TYPE_CHECKING``), function-level imports
of the package only where listed below with their reason, small modules, re-exports only at the
top, no private names imported across packages, and one groups type whose ``None`` means "no group"
everywhere."""

from __future__ import annotations

import ast
import functools
import inspect
import pathlib
import re

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


# Packages, lowest first; a module imports from its own package and the groups below its own.
PACKAGE_LAYERS = [
    {"hybridshard.topology", "hybridshard.comm_bytes", "hybridshard.options"},  # leaves: nothing of hybridshard
    {"hybridshard.link_cost"},  # the racks' cost model: comm_bytes only
    {"hybridshard.runtime", "hybridshard.diagnostics", "hybridshard.launcher"},
    {"hybridshard.state", "hybridshard.estimates"},
    {"hybridshard.ft"},
    {"hybridshard.handle", "hybridshard.checkpoint", "hybridshard.debug"},  # shard's handle class, the namespaces
    {"hybridshard"},  # the top-level re-exports (hybridshard/__init__.py)
    {"hybridshard.integrations", "hybridshard.bench"},
    {"hybridshard.cli"},
    {"hybridshard.__main__"},
]

# The runtime's layers, lowest first (hybridshard/runtime/__init__.py); a module imports from its own
# layer and those below.
RUNTIME_LAYERS = [
    "hybridshard.runtime.trace",
    "hybridshard.runtime.faults",
    "hybridshard.runtime.comm",
    "hybridshard.runtime.comm.executors",
    "hybridshard.runtime.grads",
    "hybridshard.runtime.units",
    "hybridshard.runtime.engine",
    "hybridshard.runtime.optim",
    "hybridshard.runtime.setup",
]

# Imports of the package inside a function, by reason: "importer: imported ..." (names under `hybridshard.`,
# `hybridshard` for the package itself); any other import is at module level.
_CLI = "start-up time of the CLI: `hybridshard <command>` (and --help) imports only what that command runs"
_PROBE = "optional dependency: probing imports psutil and NVML, needed only when discovering a node"
_BY_REASON = {
    _CLI: """
        cli.bench: bench.job bench.report bench.worker bench.rack_job
        cli.launch: topology.smi launcher.placement
        cli.plan: topology.smi
        cli.topo: topology.smi topology.report topology.findings topology.cluster topology.planner
        """,
    _CLI + " (torch and DCP for `ckpt` only)": "cli.ckpt: state.checkpoint state.reader",
    _PROBE: """
        cli.launch: topology.probe
        cli.topo: topology.probe
        diagnostics.bandwidth: topology.probe
        topology.cluster: topology.probe
        topology.groups: topology.probe
        topology.job_nic: topology.probe
        topology.world_hops: topology.probe
        """,
    _CLI + " (torch for --measure only)": "cli.topo: diagnostics.bandwidth",
    _CLI + " (torch.distributed for --cluster only)": "cli.topo: topology.groups",
    _CLI + " (`hybridshard bench` reads its config without the runtime)": "bench.config: hybridshard options",
    "summary assembles the view with cluster's assemble_cluster: a module-level import each way would be a cycle":
        "topology.cluster: topology.summary",
    "asks shares peers' reading of the heartbeats between the ranks asking at once, and peers' ask and table "
    "go through it: a module-level import each way would be a cycle": "runtime.faults.peers: runtime.faults.asks",
    "smi imports probe (psutil, NVML); " + _PROBE: "topology.synthetic: topology.smi",
    "nvml_recorded imports nvml: resolved on first use": "topology.nvml: topology.nvml_recorded",
    "run as a script (`main`), it imports itself as a module": "topology.nvml: topology.nvml",
    "only the package's folder, for the child processes' path": "launcher.local_cluster: hybridshard",
}


def _function_imports(by_reason: dict[str, str]) -> dict[tuple[str, str], str]:
    """``{(importer, imported): reason}`` from :data:`_BY_REASON`'s rows."""
    full = lambda n: n if n == "hybridshard" else f"hybridshard.{n}"  # noqa: E731
    out = {}
    for reason, rows in by_reason.items():
        for row in rows.strip().splitlines():
            importer, imported = row.split(":")
            out.update({(full(importer.strip()), full(t)): reason for t in imported.split()})
    return out


FUNCTION_IMPORTS = _function_imports(_BY_REASON)


def _imports(module: str, path: pathlib.Path) -> list[tuple[str, ast.stmt, str]]:
    """``(imported module, node, where)`` for every import of the package in ``module``; ``where`` is
    ``"module"``, ``"type_checking"`` (under ``if TYPE_CHECKING:``) or ``"function"``. Relative imports
    are resolved; ``from pkg import name`` names ``pkg.name`` when that is a module."""
    modules = _modules_by_name()
    is_package = path.name == "__init__.py"
    out: list[tuple[str, ast.stmt, str]] = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
                continue
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.body:
                    visit_one(sub, "type_checking" if where == "module" else where)
                for sub in child.orelse:
                    visit_one(sub, where)
                continue
            visit_one(child, where)

    def visit_one(child: ast.AST, where: str) -> None:
        if isinstance(child, ast.Import):
            out.extend((a.name, child, where) for a in child.names if _ours(a.name))
        elif isinstance(child, ast.ImportFrom):
            base = child.module or ""
            if child.level:
                parts = module.split(".")
                keep = len(parts) - child.level + (1 if is_package else 0)
                base = ".".join(parts[:keep] + ([base] if base else []))
            if not _ours(base):
                return
            for alias in child.names:
                sub = f"{base}.{alias.name}"
                out.append((sub if sub in modules else base, child, where))
        else:
            visit(child, where)

    visit(ast.parse(path.read_text()), "module")
    return out


def _ours(name: str) -> bool:
    return name == "hybridshard" or name.startswith("hybridshard.")


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def _modules_by_name() -> frozenset[str]:
    names = set()
    for name in _modules():
        names.add(name.removesuffix(".__init__"))
    return frozenset(names)


def _rank(name: str, layers: list) -> int | None:
    """Index of the (longest) layer holding ``name``, else None."""
    best, best_len = None, -1
    for i, layer in enumerate(layers):
        for prefix in (layer if isinstance(layer, set) else {layer}):
            if (name == prefix or name.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = i, len(prefix)
    return best


def _package(name: str) -> str:
    """The package a module belongs to for PACKAGE_LAYERS (``hybridshard.__init__`` -> ``hybridshard``)."""
    name = name.removesuffix(".__init__")
    if name in ("hybridshard", "hybridshard.__main__"):
        return name
    if name.startswith("hybridshard.topology"):
        return "hybridshard.topology"
    return ".".join(name.split(".")[:2])


def _layer_violations() -> list[str]:
    found = []
    for name, path in sorted(_modules().items()):
        me = name.removesuffix(".__init__")
        for target, node, where in _imports(me, path):
            if where == "type_checking":
                continue  # a back-reference for annotations only
            mine, theirs = _package(me), _package(target)
            if mine != theirs:
                a, b = _rank(mine, PACKAGE_LAYERS), _rank(theirs, PACKAGE_LAYERS)
                assert a is not None and b is not None, f"{mine} or {theirs} missing from PACKAGE_LAYERS"
                if b >= a and (me, target) not in FUNCTION_IMPORTS:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {me} ({mine}) imports {target} ({theirs}), "
                                 "not from a package below it")
            elif mine == "hybridshard.runtime" and me != "hybridshard.runtime":
                a, b = _rank(me, RUNTIME_LAYERS), _rank(target, RUNTIME_LAYERS)
                assert a is not None, f"{me} is in no layer of RUNTIME_LAYERS"
                if b is None or b > a:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {me} ({RUNTIME_LAYERS[a]}) imports {target}, "
                                 "from a higher runtime layer; move the code down or import it under TYPE_CHECKING")
    return found


def test_imports_go_down_only():
    found = _layer_violations()
    assert not found, "\n".join(found)


def test_function_level_imports_are_listed():
    found = []
    for name, path in sorted(_modules().items()):
        me = name.removesuffix(".__init__")
        for target, node, where in _imports(me, path):
            if where == "function" and (me, target) not in FUNCTION_IMPORTS:
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {me} imports {target} inside a function")
    assert not found, "import at module level, or add the pair to FUNCTION_IMPORTS with its reason:\n" + "\n".join(found)
    present = {(n.removesuffix(".__init__"), t) for n, p in _modules().items()
               for t, _, w in _imports(n.removesuffix(".__init__"), p) if w == "function"}
    stale = set(FUNCTION_IMPORTS) - present
    assert not stale, f"FUNCTION_IMPORTS lists imports that no longer exist: {sorted(stale)}"


def test_every_runtime_module_is_in_a_layer_and_every_layer_exists():
    names = _modules_by_name()
    for layer in RUNTIME_LAYERS:
        assert layer in names, f"{layer} is a layer but no module"
    loose = [n for n in names if n.startswith("hybridshard.runtime.") and _rank(n, RUNTIME_LAYERS) is None]
    assert not loose, f"runtime modules in no layer: {loose}"


SCRIPT_DIRS = ("benchmarks", "examples", "launch")


def _test_imports(path: pathlib.Path) -> list[int]:
    """Lines of ``path`` that import ``tests`` or a module under it (``import tests.x``,
    ``from tests import x``, ``from tests.x import y``), anywhere in the file."""
    return [node.lineno for node in ast.walk(ast.parse(path.read_text()))
            if (isinstance(node, ast.Import) and any(a.name == "tests" or a.name.startswith("tests.") for a in node.names))
            or (isinstance(node, ast.ImportFrom) and not node.level
                and (node.module == "tests" or (node.module or "").startswith("tests.")))]


def test_scripts_do_not_import_the_tests():
    """benchmarks/, examples/ and launch/ stand without tests/: the tests may import them, not the reverse."""
    found = [f"{path.relative_to(ROOT)}:{line}" for folder in SCRIPT_DIRS for path in sorted((ROOT / folder).rglob("*.py"))
             for line in _test_imports(path)]
    assert not found, "scripts import tests/; move what they need into benchmarks/ or the package:\n" + "\n".join(found)


MAX_NOTE_LINES = 20
_NOTE_HEADING = re.compile(r"\[Note: [^\]]+\]")


def _note_blocks(path: pathlib.Path) -> list[tuple[str, int, int]]:
    """``(heading, first line, number of lines)`` of every note block in ``path``. A block is measured
    in source lines, heading included, trailing blank lines not:

    - in a docstring (module, class or function), a line that is exactly ``[Note: <title>]`` (after
      stripping) opens a block, which runs to the line before the next such heading in the same
      docstring, or to the docstring's last line: paragraphs after a note belong to it;
    - in ``#`` comments, a run of consecutive comment lines whose first line's text starts with
      ``[Note: <title>]`` is a block (the heading may carry text after it); the run ends at the first
      line that is not a comment.

    A citation (``see [Note: ...]``) is neither: it does not stand alone on its line or open a run.
    """
    text = path.read_text()
    lines = text.splitlines()
    blocks = []
    i = 0
    while i < len(lines):
        comment = lines[i].strip()
        if comment.startswith("#") and _NOTE_HEADING.match(comment.lstrip("#").strip()):
            j = i + 1
            while j < len(lines) and lines[j].strip().startswith("#"):
                j += 1
            blocks.append((_NOTE_HEADING.match(comment.lstrip("#").strip()).group(), i + 1, j - i))
            i = j
        else:
            i += 1
    for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        doc = ast.get_docstring(node, clean=False)
        if not doc:
            continue
        doc_lines = doc.splitlines()
        heads = [k for k, line in enumerate(doc_lines) if _NOTE_HEADING.fullmatch(line.strip())]
        for n, k in enumerate(heads):
            end = heads[n + 1] if n + 1 < len(heads) else len(doc_lines)
            while end > k + 1 and not doc_lines[end - 1].strip():
                end -= 1
            blocks.append((doc_lines[k].strip(), node.body[0].lineno + k, end - k))
    return blocks


def test_notes_are_short():
    """A note says what a reader of that code needs now (STYLE.md); history and measurements go to docs/."""
    long = [f"{path.relative_to(ROOT)}:{line}: {heading} is {n} lines"
            for path in _modules().values() for heading, line, n in _note_blocks(path) if n > MAX_NOTE_LINES]
    assert not long, f"notes over {MAX_NOTE_LINES} lines; cut them, move history and figures to docs/:\n" + "\n".join(long)


def test_note_blocks_are_measured_as_documented(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text('"""Title.\n\n[Note: a]\none\n\ntwo\n\n[Note: b]\nthree\n"""\n\n'
                      "x = 1  # see [Note: a]\n# [Note: c] text\n# more\ny = 2\n")
    assert _note_blocks(sample) == [("[Note: c]", 13, 2), ("[Note: a]", 3, 4), ("[Note: b]", 8, 2)]


def test_executors_meet_the_protocol():
    from hybridshard.runtime.comm.executors.base import Executor
    from hybridshard.runtime.comm.executors.select import ExecutorKind, make_executor

    for kind in ExecutorKind:
        executor = make_executor(kind, torch.device("cpu"))
        assert isinstance(executor, Executor), kind
        for method in ("gather", "submit", "drain", "end_step", "abort"):
            assert callable(getattr(executor, method)), (kind, method)


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
    namespaces = {n for n in hs.__all__ if inspect.ismodule(getattr(hs, n))}  # hs.checkpoint, hs.debug: docs/api.md
    clashes = [n for n in hs.__all__ if f"hybridshard.{n}" in _modules() and n not in namespaces]
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
