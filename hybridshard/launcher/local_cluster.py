"""``launch/local-cluster``: run one multi-node job on this machine, one network namespace per node.

    launch/local-cluster --nodes 2 --procs-per-node 2 [--inter-node-bandwidth 1gbit] [--latency 200us] -- CMD...
    launch/local-cluster --nodes 4 --racks 2 --spine-rate 100mbit [--cut-spine-after 20] -- CMD...
    launch/local-cluster --nodes 4 --racks 2 --set-rate host3=50mbit --set-rate-when 'step 40 ' -- CMD...

Every host runs ``hybridshard launch --nnodes N --node-rank K --nproc-per-node M`` with the rendezvous
on ``host0``, so CMD starts exactly as it would on a real cluster. Output is streamed line by line,
prefixed with the host name; the exit status is that of the first host that failed (124 on timeout,
130 on Ctrl-C). The network is described in [Note: local network] and always removed, see
[Note: cleanup] in :mod:`hybridshard.launcher.netns`. With ``--racks`` the hosts sit in racks joined by a
spine ([Note: racks and a spine] in :mod:`hybridshard.launcher.spine`), whose counters are logged and
which can be cut mid-job; one host's link or the spine can be shaped down mid-job
(:mod:`hybridshard.launcher.spine_run`).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from typing import IO, Callable, Sequence

from hybridshard.launcher.netns import IFNAME, LocalNetwork, Shaping, check_rights, remove_leftovers
from hybridshard.launcher.spine import check_racks
from hybridshard.launcher.spine_run import NetWatch, RateChange, SpineCut
from hybridshard.launcher.supervisor import TIMEOUT_EXIT, HostFault, RunState, Supervisor
from hybridshard.launcher.runlog import default_run_dir
from hybridshard.launcher.summary import render_summary

logger = logging.getLogger(__name__)

__all__ = ["main", "ClusterOptions", "HostFault", "RateChange", "RunState", "SpineCut", "Supervisor", "TIMEOUT_EXIT",
           "free_port", "run_cluster"]

_Supervisor = Supervisor  # the name hybridshard/bench/job.py uses

RIGHTS_EXIT = 3
INTERRUPT_EXIT = 130
_CUT_FAULT_SECONDS = "5"
"""``HYBRIDSHARD_FAULT_SECONDS`` of a run that cuts its spine, unless set: the store's rack then names
the partition within about 20 s of the cut (5 s, then two readings of the heartbeats, 3 s and 9 s)."""
# Variables that would make a host's launcher think it is already a rank, or inside SLURM.
_DROPPED_ENV_PREFIXES = ("SLURM_", "TORCHELASTIC_")
_DROPPED_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                "MASTER_PORT", "HYBRIDSHARD_NODE_NAME", "HYBRIDSHARD_CPU_BINDING")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` now, for a rendezvous on this machine."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


@dataclass(frozen=True)
class ClusterOptions:
    num_nodes: int
    procs_per_node: int
    command: tuple[str, ...]
    shaping: Shaping = Shaping()
    timeout_s: float | None = None
    port: int = 29500
    launch_args: tuple[str, ...] = ()
    """Extra ``hybridshard launch`` options given to every host (e.g. ``--max-restarts 0``)."""
    fault: HostFault | None = None
    log_dir: str | None = None
    """The run directory every host writes under (the hosts share this machine's file system); the
    failure summary, merged from every host's record, is printed by the local cluster."""
    racks: int | None = None
    """Split the hosts into this many racks joined by a spine ([Note: racks and a spine] in
    :mod:`hybridshard.launcher.spine`); ``None``: every host on one bridge."""
    spine: Shaping = Shaping()
    """The spine's shaping: each rack's uplink, in each direction (with :attr:`racks`)."""
    spine_cut: SpineCut | None = None
    """Cut the spine once, mid-job (with :attr:`racks`)."""
    rate_changes: tuple[RateChange, ...] = ()
    """Shape one host's link, or the spine (with :attr:`racks`), to a rate once each, mid-job."""

    def __post_init__(self) -> None:
        if self.num_nodes < 1:
            raise ValueError(f"--nodes must be >= 1, found {self.num_nodes}")
        if self.procs_per_node < 1:
            raise ValueError(f"--procs-per-node must be >= 1, found {self.procs_per_node}")
        if not self.command:
            raise ValueError("no command given; put it after `--`, e.g. -- python -m hybridshard topo --cluster")
        if self.timeout_s is not None and self.timeout_s <= 0:
            raise ValueError(f"--timeout must be > 0 seconds, found {self.timeout_s}")
        if self.fault is not None and not 0 <= self.fault.host < self.num_nodes:
            raise ValueError(f"--kill-host must be 0..{self.num_nodes - 1}, found {self.fault.host}")
        if self.racks is None and (self.spine.active or self.spine_cut is not None):
            raise ValueError("expected --racks with the --spine-*/--cut-spine-* options, found no --racks; "
                             "pass --racks R (the spine joins the racks)")
        if self.racks is not None:
            check_racks(self.num_nodes, self.racks)
        for change in self.rate_changes:
            if change.host is None and self.racks is None:
                raise ValueError("expected --racks with --set-rate spine=RATE, found no --racks; pass --racks R")
            if change.host is not None and change.host >= self.num_nodes:
                raise ValueError(f"expected --set-rate host0..host{self.num_nodes - 1}, found host{change.host}; "
                                 f"pass a host of the {self.num_nodes}")


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _package_root() -> str:
    import hybridshard

    return os.path.dirname(os.path.dirname(os.path.abspath(hybridshard.__file__)))


def host_env(base: dict[str, str] | os._Environ) -> dict[str, str]:
    env = {k: v for k, v in base.items() if k not in _DROPPED_ENV and not k.startswith(_DROPPED_ENV_PREFIXES)}
    root = _package_root()
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
    env["PYTHONUNBUFFERED"] = "1"
    env["GLOO_SOCKET_IFNAME"] = IFNAME  # gloo would otherwise resolve the hostname for its address
    env["NCCL_SOCKET_IFNAME"] = IFNAME
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def launch_argv(opts: ClusterOptions, node_rank: int, rdzv_host: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "hybridshard", "launch", "--nnodes", str(opts.num_nodes), "--node-rank", str(node_rank),
            "--nproc-per-node", str(opts.procs_per_node), "--master-addr", rdzv_host,
            "--master-port", str(opts.port), *(["--log-dir", opts.log_dir, "--no-summary"] if opts.log_dir else []),
            *opts.launch_args, "--", *opts.command]


def run_cluster(opts: ClusterOptions, out: IO[str] = sys.stdout, *,
                on_network: Callable[[LocalNetwork], None] | None = None) -> int:
    """Build the network, run the job on every host, always tear everything down. ``on_network`` is
    called with the network once it is up, before the hosts start: a caller keeps it to read the
    spine's counters, change its rate or cut it while the job runs (see :class:`LocalNetwork`)."""
    reason = check_rights()
    if reason is not None:
        print(
            f"local-cluster: cannot create network namespaces: {reason}.\n"
            "It needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN). Without it, run the nodes as two torchrun agents on "
            "this host with HYBRIDSHARD_NODE_NAME set per agent (see docs/launching.md).",
            file=sys.stderr,
        )
        return RIGHTS_EXIT
    remove_leftovers()
    net = LocalNetwork(opts.num_nodes, opts.shaping, racks=opts.racks, spine=opts.spine)
    watch: NetWatch | None = None
    sup = Supervisor(out, opts.fault, kill_host=lambda name: net.kill_host(next(h for h in net.hosts if h.name == name)),
                     on_line=lambda host, line: watch.on_line(host, line) if watch is not None else None)
    previous = {}

    def interrupt(signum: int, _frame: object) -> None:
        raise _Interrupted(signum)

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        previous[sig] = signal.signal(sig, interrupt)
    try:
        net.up()
        sup.say(f"{opts.num_nodes} hosts x {opts.procs_per_node} processes on network {net.tag}"
                + (f", links shaped: rate {opts.shaping.rate or '-'} latency {opts.shaping.latency or '-'}"
                   if opts.shaping.active else ""))
        if net.spine is not None:
            sup.say(f"{len(net.spine.racks)} racks of {len(net.spine.racks[0].hosts)} hosts joined by a spine"
                    + (f", each rack's uplink shaped: rate {opts.spine.rate or '-'} latency {opts.spine.latency or '-'}"
                       if opts.spine.active else ""))
        if net.spine is not None or opts.rate_changes:
            watch = NetWatch(net, sup.say, opts.log_dir, opts.spine_cut, opts.rate_changes)
        if on_network is not None:
            on_network(net)
        env = host_env(os.environ)
        if opts.spine_cut is not None:
            # The ranks' check of a stuck collective (60 s by default) would report the cut after a minute.
            env.setdefault("HYBRIDSHARD_FAULT_SECONDS", _CUT_FAULT_SECONDS)
        rdzv_host = net.hosts[0].name
        for h in net.hosts:
            # The hosts share this machine's kernel, so discovery would see one node (see [Note: one
            # machine, one node] in hybridshard.topology.probe); name each host's node after it.
            host = dict(env, HYBRIDSHARD_NODE_NAME=h.name)
            if h.network_path is not None:
                host["HYBRIDSHARD_NETWORK_PATH"] = h.network_path
            sup.start(h.name, net.host_argv(h, launch_argv(opts, h.index, rdzv_host)), host)
        if watch is not None:
            watch.start()
        rc = sup.wait(opts.timeout_s)
        if watch is not None:
            watch.stop()
        if rc != 0 and opts.log_dir:
            with sup.lock:
                out.write("\n".join(render_summary(opts.log_dir, expected_nodes=opts.num_nodes)) + "\n")
                out.flush()
        return rc
    except _Interrupted as exc:
        sup.say(f"interrupted by {exc}; stopping every host")
        return INTERRUPT_EXIT
    except RuntimeError as exc:
        print(f"local-cluster: {exc}", file=sys.stderr)
        return 1
    finally:
        # Cleanup must finish even if another signal arrives now.
        for sig in previous:
            signal.signal(sig, signal.SIG_IGN)
        try:
            sup.stop()
            if watch is not None:
                watch.stop()
            problems = net.teardown()
            if problems:
                print(f"local-cluster: cleanup problems: {problems}", file=sys.stderr)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="local-cluster",
        description="Run CMD as a multi-node job on this machine: one network namespace per node.",
        usage="local-cluster --nodes N --procs-per-node M [--inter-node-bandwidth RATE] [--latency DELAY] "
              "[--racks R [--spine-rate RATE] [--spine-latency DELAY] [--cut-spine-after S | --cut-spine-when REGEX]] "
              "[--set-rate hostK=RATE|spine=RATE ... (--set-rate-after S | --set-rate-when REGEX)] -- CMD...",
    )
    p.add_argument("--nodes", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--inter-node-bandwidth", metavar="RATE", help="shape each host's link, e.g. 1gbit, 50mbit")
    p.add_argument("--latency", metavar="DELAY", help="one-way delay between hosts, e.g. 200us (needs netem)")
    p.add_argument("--racks", type=int, metavar="R", help="split the hosts into R racks (contiguous blocks) "
                   "joined by a spine; each host gets HYBRIDSHARD_NETWORK_PATH=pod0/rack<j>")
    p.add_argument("--spine-rate", metavar="RATE", help="(with --racks) shape each rack's uplink, e.g. 100mbit")
    p.add_argument("--spine-latency", metavar="DELAY", help="(with --racks) one-way delay between racks, e.g. 1ms")
    p.add_argument("--cut-spine-after", type=float, metavar="SECONDS",
                   help="(with --racks) set every rack's uplink down this long after the hosts started")
    p.add_argument("--cut-spine-when", metavar="REGEX",
                   help="(with --racks) set every rack's uplink down once a line of any host's output matches REGEX")
    p.add_argument("--set-rate", action="append", default=[], metavar="TARGET=RATE",
                   help="shape hostK's link (hostK=RATE) or, with --racks, the spine (spine=RATE) mid-job (repeatable)")
    p.add_argument("--set-rate-after", type=float, metavar="SECONDS",
                   help="(with --set-rate) this long after the hosts started")
    p.add_argument("--set-rate-when", metavar="REGEX",
                   help="(with --set-rate) once a line of any host's output matches REGEX")
    p.add_argument("--timeout", type=float, metavar="SECONDS", help="stop everything after this long (exit 124)")
    p.add_argument("--port", type=int, default=29500, help="rendezvous port on host0 (default 29500)")
    p.add_argument("--launch-arg", action="append", default=[], metavar="ARG",
                   help="extra argument for every host's `hybridshard launch` (repeatable)")
    p.add_argument("--kill-host", type=int, metavar="K",
                   help="SIGKILL every process of hostK once a line of its output matches --kill-when")
    p.add_argument("--kill-when", metavar="REGEX", default=".", help="(with --kill-host) the line to wait for")
    p.add_argument("--restart-after", type=float, metavar="SECONDS",
                   help="(with --kill-host) start the killed host again after this long")
    p.add_argument("--log-dir", metavar="DIR", help="the run directory: every rank's output, per host "
                   "(default hybridshard-logs/run-<date>-<time>); the summary of a failed job is read from it")
    p.add_argument("--check", action="store_true",
                   help="only say whether this machine allows the namespaces (exit 0) or not (exit 3)")
    p.add_argument("-v", "--verbose", action="count", default=0)
    return p


def _spine_shaping(rate: str | None, latency: str | None) -> Shaping:
    try:
        return Shaping(rate=rate, latency=latency)
    except ValueError as exc:  # Shaping names the host links' options
        raise ValueError(str(exc).replace("--inter-node-bandwidth", "--spine-rate").replace("--latency", "--spine-latency")) from None


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" in argv:
        split = argv.index("--")
        ours, command = argv[:split], argv[split + 1:]
    else:
        ours, command = argv, []
    args = build_parser().parse_args(ours)
    logging.basicConfig(level=logging.WARNING - 10 * min(args.verbose, 2),
                        format="%(levelname)s %(name)s: %(message)s", stream=sys.stderr)
    if args.check:
        reason = check_rights()
        print("local-cluster: network namespaces can be created here" if reason is None
              else f"local-cluster: cannot create network namespaces here: {reason}")
        return 0 if reason is None else RIGHTS_EXIT
    try:
        opts = ClusterOptions(
            num_nodes=args.nodes, procs_per_node=args.procs_per_node, command=tuple(command),
            shaping=Shaping(rate=args.inter_node_bandwidth, latency=args.latency),
            timeout_s=args.timeout, port=args.port, launch_args=tuple(args.launch_arg),
            fault=None if args.kill_host is None else HostFault(args.kill_host, args.kill_when, args.restart_after),
            log_dir=os.path.abspath(args.log_dir or default_run_dir(os.environ)),
            racks=args.racks, spine=_spine_shaping(args.spine_rate, args.spine_latency),
            spine_cut=(None if args.cut_spine_after is None and args.cut_spine_when is None
                       else SpineCut(args.cut_spine_after, args.cut_spine_when)),
            rate_changes=tuple(RateChange.parse(t, after_s=args.set_rate_after, when=args.set_rate_when)
                               for t in args.set_rate),
        )
    except ValueError as exc:
        print(f"local-cluster: error: {exc}", file=sys.stderr)
        return 2
    return run_cluster(opts)


if __name__ == "__main__":
    sys.exit(main())
