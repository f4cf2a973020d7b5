"""``hybridshard launch [options] SCRIPT [ARGS...]``: torchrun with settings resolved from the cluster.

Options this command understands are resolved (options > SLURM > defaults, see
:mod:`hybridshard.launcher.settings`); every other torchrun option passes through unchanged. The
program starts at the first argument that is not an option (or after ``--``); it may be a script,
``python -m MODULE ...`` or any executable.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import logging
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Sequence

from hybridshard.launcher.ft import fault_tolerant
from hybridshard.launcher.command import LaunchCommand, build_command, make_entry, run_command
from hybridshard.launcher.numa import compute_binding
from hybridshard.launcher.runlog import NodeLogs, default_run_dir, read_node_records
from hybridshard.launcher.settings import LaunchOptions, resolve_settings
from hybridshard.launcher.summary import render_summary
from hybridshard.topology.netpath import NETWORK_PATH_ENV, parse_path

logger = logging.getLogger(__name__)

_VALUE_OPTIONS = ("--nnodes", "--node-rank", "--nproc-per-node", "--rdzv-backend", "--rdzv-endpoint",
                  "--rdzv-id", "--master-addr", "--master-port", "--max-restarts", "--lighthouse", "--from-smi",
                  "--log-dir", "--network-path")
_FLAG_OPTIONS = ("--bind-numa", "--dry-run", "--fault-tolerant", "--verbose", "--no-summary", "-h", "--help")
_ENTRY_FLAGS = {"-m": "module", "--module": "module", "--no-python": "no_python", "--no_python": "no_python"}
_REJECTED = {"--standalone": "give no rendezvous options for a one-node job (a free local port is used)"}

USAGE = "hybridshard launch [options] [torchrun options] SCRIPT|python -m MODULE|PROGRAM [ARGS...]"


def _our_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hybridshard launch", usage=USAGE, description=__doc__.split("\n\n")[0],
                                epilog="Any other torchrun option (python -m torch.distributed.run --help) passes through.")
    p.add_argument("--nnodes", help="number of nodes, or MIN:MAX (default: SLURM_NNODES, else 1)")
    p.add_argument("--node-rank", type=int, help="this node's rank (default: SLURM_NODEID, else 0)")
    p.add_argument("--nproc-per-node", help="processes on this node (default: visible GPUs, or 1 without GPUs)")
    p.add_argument("--rdzv-backend", help="static (default: fixed node ranks) or c10d (elastic)")
    p.add_argument("--rdzv-endpoint", help="HOST[:PORT] of the rendezvous (default: first SLURM host)")
    p.add_argument("--rdzv-id", help="job id for the c10d rendezvous (default: SLURM_JOB_ID)")
    p.add_argument("--master-addr", help="same as the host of --rdzv-endpoint")
    p.add_argument("--master-port", type=int, help="same as the port of --rdzv-endpoint")
    p.add_argument("--max-restarts", type=int,
                   help="restart every worker of every node up to N times when one fails (torchrun's; "
                        "uses the c10d rendezvous and a new store per attempt, see docs/checkpointing.md)")
    p.add_argument("--fault-tolerant", action="store_true",
                   help="each node its own job (a replica group of hybridshard.FaultTolerance), restarted alone; "
                        "see docs/fault-tolerance.md")
    p.add_argument("--lighthouse", help="HOST:PORT of torchft's lighthouse (default: node 0 starts one)")
    p.add_argument("--bind-numa", action="store_true", help="pin each local rank to the CPUs of its GPU's NUMA node")
    p.add_argument("--dry-run", action="store_true", help="print the command and environment, run nothing")
    p.add_argument("--from-smi", metavar="FILE",
                   help="with --dry-run: plan for the machine `nvidia-smi topo -m` printed into FILE")
    p.add_argument("--network-path", metavar="PATH",
                   help="where this node sits in the network, top level first (e.g. pod1/rack07): sets "
                        f"{NETWORK_PATH_ENV} for the ranks, read before Slurm's and Kubernetes' topology "
                        "(docs/topology.md, \"Racks and pods\")")
    p.add_argument("--log-dir", help="the run directory: each rank's stdout/stderr in its own file under "
                                     "LOG_DIR/node<K>/ (default: hybridshard-logs/run-<date>-<time>, or job<SLURM_JOB_ID>); "
                                     "give every node the same one on a shared file system")
    p.add_argument("--verbose", action="store_true",
                   help="also show torchrun's own output and every rank's traceback on the console")
    p.add_argument("--no-summary", action="store_true",
                   help="print no failure summary (the caller prints one, as launch/local-cluster does)")
    return p


@functools.lru_cache(maxsize=1)
def _torchrun_arity() -> dict[str, int]:
    """Every torchrun option string -> how many values it takes (0 or 1)."""
    from torch.distributed.run import get_args_parser

    arity = {}
    for action in get_args_parser()._actions:
        for opt in action.option_strings:
            arity[opt] = 0 if action.nargs == 0 else 1
    return arity


def _canonical(opt: str) -> str:
    return opt.replace("_", "-") if opt.startswith("--") else opt


@dataclass(frozen=True)
class SplitArgv:
    ours: tuple[str, ...]
    passthrough: tuple[str, ...]
    entry: tuple[str, ...]
    module: bool = False
    no_python: bool = False


def split_argv(argv: Sequence[str]) -> SplitArgv:
    """Separate this command's options, torchrun's options and the program with its arguments."""
    ours: list[str] = []
    passthrough: list[str] = []
    flags = {"module": False, "no_python": False}
    i = 0
    while i < len(argv):
        token = argv[i]
        if token == "--":
            i += 1
            break
        if not token.startswith("-") or token == "-":
            break
        name, eq, _ = token.partition("=")
        canon = _canonical(name)
        if canon in _REJECTED:
            raise ValueError(f"{name} is not supported by hybridshard launch: {_REJECTED[canon]}")
        if name in _ENTRY_FLAGS:
            flags[_ENTRY_FLAGS[name]] = True
            i += 1
            continue
        if canon in _VALUE_OPTIONS or canon in _FLAG_OPTIONS:
            target, takes_value = ours, canon in _VALUE_OPTIONS
            token = canon + token[len(name):]
        elif name in _torchrun_arity():
            target, takes_value = passthrough, _torchrun_arity()[name] == 1
        else:
            raise ValueError(
                f"unknown option {name!r}: neither a hybridshard launch option nor a torchrun option; "
                "see `hybridshard launch --help` and `python -m torch.distributed.run --help`, "
                "or put the program after `--`"
            )
        target.append(token)
        i += 1
        if takes_value and not eq:
            if i >= len(argv):
                raise ValueError(f"option {name} expects a value, found the end of the command line")
            target.append(argv[i])
            i += 1
    return SplitArgv(tuple(ours), tuple(passthrough), tuple(argv[i:]), **flags)


def _visible_gpus():
    """``(node probe, visible GPU uuids)`` of this host, CUDA_VISIBLE_DEVICES applied."""
    from hybridshard.topology.probe import probe_rank

    probe = probe_rank(rank=0, local_rank=0, world_size=1)
    return probe.node, probe.visible_gpu_uuids


def prepare(argv: Sequence[str], env=None, *, probe: Callable | None = None) -> tuple[argparse.Namespace, LaunchCommand]:
    """Parse ``argv`` and build this node's command (no side effects besides probing)."""
    env = os.environ if env is None else env
    probe = probe or _visible_gpus
    split = split_argv(argv)
    opts = _our_parser().parse_args(list(split.ours))
    if opts.from_smi:
        probe = _smi_gpus(opts)
    if opts.bind_numa and "--run-path" in split.passthrough:
        raise ValueError("--bind-numa starts each worker through a wrapper; it cannot be combined with --run-path")
    entry = make_entry(split.entry, module=split.module, no_python=split.no_python)
    probed = {}

    def node_and_gpus():
        if not probed:
            probed["v"] = probe()
        return probed["v"]

    options = LaunchOptions(
        nnodes=opts.nnodes, node_rank=opts.node_rank, nproc_per_node=opts.nproc_per_node,
        rdzv_backend=opts.rdzv_backend, rdzv_endpoint=opts.rdzv_endpoint, rdzv_id=opts.rdzv_id,
        master_addr=opts.master_addr, master_port=opts.master_port, max_restarts=opts.max_restarts,
    )
    if opts.fault_tolerant:  # nodes meet only at the lighthouse; restarts are each node's own
        options = dataclasses.replace(options, rdzv_backend=options.rdzv_backend or "static", max_restarts=None)
    settings = resolve_settings(options, env, count_gpus=lambda: len(node_and_gpus()[1]))
    logs = NodeLogs.for_node(opts.log_dir or default_run_dir(env), settings.node_rank if settings.node_rank_fixed else None,
                             fault_tolerant=opts.fault_tolerant)
    opts.nnodes_expected = None if ":" in settings.nnodes or opts.fault_tolerant else int(settings.nnodes)
    ft = None
    if opts.fault_tolerant:
        ft = fault_tolerant(settings, opts.lighthouse, max_restarts=opts.max_restarts)
        settings = ft.settings
    elif opts.lighthouse is not None:
        raise ValueError("--lighthouse is the lighthouse of --fault-tolerant; add --fault-tolerant or drop it")
    opts.lighthouse_argv = ft.lighthouse_argv if ft is not None else None
    binding = None
    if opts.bind_numa:
        if settings.nproc_int is None:
            raise ValueError(f"--bind-numa needs a numeric --nproc-per-node, found {settings.nproc_per_node!r}")
        node, visible = node_and_gpus()
        allowed = None if opts.from_smi else os.sched_getaffinity(0)  # another machine's CPUs
        binding = compute_binding(node, visible, settings.nproc_int, allowed_cpus=allowed)
    if opts.from_smi:
        from hybridshard.launcher.placement import describe_local_ranks

        opts.placement = describe_local_ranks(node_and_gpus()[0], settings.nproc_int or len(node_and_gpus()[1]))
    command = build_command(settings, entry, passthrough=split.passthrough, binding=binding, logs=logs)
    if ft is not None:
        command = dataclasses.replace(command, env=command.env + ft.env)
    if opts.network_path is not None:
        path = "/".join(parse_path(opts.network_path, "--network-path"))
        command = dataclasses.replace(command, env=command.env + ((NETWORK_PATH_ENV, path),))
    return opts, command


def _smi_gpus(opts: argparse.Namespace) -> Callable:
    if not opts.dry_run:
        raise ValueError("--from-smi describes another machine; it needs --dry-run")
    from hybridshard.topology.smi import read_topo_matrix, with_name

    node = read_topo_matrix(opts.from_smi)
    node = with_name(node, node.node_name)
    return lambda: (node, tuple(g.uuid for g in node.gpus))


def run(args: argparse.Namespace) -> int:
    argv = list(getattr(args, "argv", [])) + list(getattr(args, "extra", []) or [])
    try:
        wants_help = not argv or any(t in ("-h", "--help") for t in split_argv(argv).ours)
    except ValueError as exc:
        print(f"hybridshard launch: error: {exc}", file=sys.stderr)
        return 2
    if wants_help:
        _our_parser().print_help()
        return 0 if argv else 2
    try:
        opts, command = prepare(argv)
    except (ValueError, ImportError) as exc:  # ImportError: --fault-tolerant without torchft installed
        print(f"hybridshard launch: error: {exc}", file=sys.stderr)
        return 2
    if opts.dry_run:
        if opts.lighthouse_argv is not None:
            print("# lighthouse started by this launcher: " + " ".join(opts.lighthouse_argv))
        for line in getattr(opts, "placement", ()):
            print(line)
        print(command.render(os.environ))
        return 0
    if opts.lighthouse_argv is None:
        rc = run_command(command, verbose=opts.verbose)
    else:
        os.makedirs(command.logs.run_dir, exist_ok=True)
        with open(os.path.join(command.logs.run_dir, "lighthouse.log"), "ab") as log:  # its routine logging
            lighthouse = subprocess.Popen(list(opts.lighthouse_argv), stdout=None if opts.verbose else log,
                                          stderr=None if opts.verbose else subprocess.STDOUT)
        try:
            rc = run_command(command, verbose=opts.verbose)
        finally:
            lighthouse.terminate()
            lighthouse.wait()
    if rc != 0 and not opts.no_summary:
        print_summary(command.logs, opts.nnodes_expected, verbose=opts.verbose)
    return rc


_MERGE_WAIT_S = 10.0
"""How long node 0 waits for the other nodes' final records (their agents end within seconds of it)."""


def print_summary(logs: NodeLogs, expected_nodes: int | None, *, verbose: bool = False) -> None:
    """This node's summary; node 0's (``show_rank0``) merges every node's record found in the run directory."""
    if not logs.show_rank0:
        own = [n for n in read_node_records(logs.run_dir) if n["dir"] == logs.node_dir]
        lines = render_summary(logs.run_dir, own, verbose=verbose)
    else:
        deadline = time.monotonic() + _MERGE_WAIT_S
        while time.monotonic() < deadline:
            nodes = read_node_records(logs.run_dir)
            if len(nodes) >= (expected_nodes or 1) and all(n.get("result") != "running" for n in nodes):
                break
            time.sleep(0.5)
        lines = render_summary(logs.run_dir, expected_nodes=expected_nodes, verbose=verbose)
    print("\n".join(lines), flush=True)


def add_parser(subparsers) -> None:
    # prefix_chars="+" hands every token after "launch" to this command untouched, so torchrun options
    # and the program's own options are never parsed by the top-level parser.
    p = subparsers.add_parser("launch", help="run torchrun with settings resolved from SLURM/GPUs",
                              prefix_chars="+", add_help=False, usage=USAGE)
    p.add_argument("argv", nargs=argparse.REMAINDER)
    p.set_defaults(func=run, accepts_extra=True)
