"""``launch/local-cluster``: run one multi-node job on this machine, one network namespace per node.

    launch/local-cluster --nodes 2 --procs-per-node 2 [--inter-node-bandwidth 1gbit] [--latency 200us] -- CMD...

Every host runs ``hybridshard launch --nnodes N --node-rank K --nproc-per-node M`` with the rendezvous
on ``host0``, so CMD starts exactly as it would on a real cluster. Output is streamed line by line,
prefixed with the host name; the exit status is that of the first host that failed (124 on timeout,
130 on Ctrl-C). The network is described in [Note: local network] and always removed, see
[Note: cleanup] in :mod:`hybridshard.launcher.netns`.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import IO, Callable, Sequence

from hybridshard.launcher.netns import IFNAME, LocalNetwork, Shaping, check_rights, remove_leftovers
from hybridshard.launcher.runlog import default_run_dir
from hybridshard.launcher.summary import render_summary

logger = logging.getLogger(__name__)

__all__ = ["main", "ClusterOptions", "HostFault", "RunState", "free_port"]

RIGHTS_EXIT = 3
TIMEOUT_EXIT = 124
INTERRUPT_EXIT = 130
_PEER_GRACE_S = 15.0
"""How long the other hosts get after one fails, before they are stopped: longer than a surviving rank
takes to say why its collective failed (it asks for up to 3 s, 6 s more when the round's leader is
lost: [Note: one reading for the ranks asking at once] in hybridshard/runtime/faults/asks.py). With 5 s,
a loaded machine stopped a survivor before its traceback. Hosts that exit sooner end the wait."""
_TERM_GRACE_S = 5.0
_POLL_S = 0.1
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


@dataclass(frozen=True)
class HostFault:
    """Kill one host (its launcher, agent and workers: the whole process group) when a line of its
    output matches ``when``, and start it again ``restart_after`` seconds later (``None``: never).
    The host's exit is then no failure of the job. For fault-tolerant jobs (docs/fault-tolerance.md)."""

    host: int
    when: str
    restart_after: float | None = None

    def __post_init__(self) -> None:
        try:
            re.compile(self.when)
        except re.error as exc:
            raise ValueError(f"--kill-when must be a regular expression, found {self.when!r}: {exc}") from None
        if self.restart_after is not None and self.restart_after < 0:
            raise ValueError(f"--restart-after must be >= 0 seconds, found {self.restart_after}")


class RunState(str, Enum):
    STARTING = "starting"
    RUNNING = "running"
    STOPPING = "stopping"
    DONE = "done"


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


class _Supervisor:
    """Starts one process per host, streams their output, and stops them all."""

    def __init__(self, out: IO[str], fault: HostFault | None = None,
                 kill_host: Callable[[str], None] | None = None) -> None:
        self.out = out
        self.lock = threading.Lock()
        self.procs: list[tuple[str, subprocess.Popen]] = []
        self.threads: list[threading.Thread] = []
        self.state = RunState.STARTING
        self.fault = fault
        self._kill_host = kill_host
        self._fault_name = f"host{fault.host}" if fault is not None else None
        self._fault_seen = threading.Event()
        self._started: dict[str, tuple[list[str], dict[str, str]]] = {}

    def start(self, name: str, argv: list[str], env: dict[str, str]) -> None:
        proc = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs = [(n, p) for n, p in self.procs if n != name] + [(name, proc)]
        self._started[name] = (argv, env)
        t = threading.Thread(target=self._pump, args=(name, proc), daemon=True)
        t.start()
        self.threads.append(t)

    def _pump(self, name: str, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        watch = self.fault is not None and name == self._fault_name
        for raw in iter(proc.stdout.readline, b""):
            line = raw.decode(errors="replace").rstrip("\n")
            if watch and not self._fault_seen.is_set() and re.search(self.fault.when, line):
                self._fault_seen.set()
            with self.lock:
                self.out.write(f"[{name}] {line}\n")
                self.out.flush()

    def _inject_fault(self, state: dict) -> None:
        """Kill the fault's host once its output matched, start it again when due; see :class:`HostFault`."""
        if not self._fault_seen.is_set():
            return
        name, now = self._fault_name, time.monotonic()
        if "killed" not in state:
            proc = dict(self.procs)[name]
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            if self._kill_host is not None:
                self._kill_host(name)
            proc.wait()
            state["killed"] = now
            self.say(f"killed {name} (every process of it)" + (
                f"; starting it again in {self.fault.restart_after:g}s" if self.fault.restart_after is not None else ""))
        elif (self.fault.restart_after is not None and "restarted" not in state
              and now >= state["killed"] + self.fault.restart_after):
            state["restarted"] = now
            self.say(f"starting {name} again")
            self.start(name, *self._started[name])

    def say(self, text: str) -> None:
        with self.lock:
            self.out.write(f"[local-cluster] {text}\n")
            self.out.flush()

    def wait(self, timeout_s: float | None) -> int:
        """Wait for every host; return the first failure's status (0 when all succeed)."""
        self.state = RunState.RUNNING
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        first_failure: tuple[str, int] | None = None
        peers_deadline = None
        fault_state: dict = {}
        while True:
            self._inject_fault(fault_state)
            codes = [(name, p.poll()) for name, p in self.procs]
            if "killed" in fault_state and "restarted" not in fault_state:
                codes = [(n, rc) for n, rc in codes if n != self._fault_name]  # killed on purpose
            for name, rc in codes:
                if rc not in (None, 0) and first_failure is None:
                    first_failure = (name, rc)
                    peers_deadline = time.monotonic() + _PEER_GRACE_S
                    self.say(f"{name} failed with exit status {rc}; stopping the other hosts in {_PEER_GRACE_S:.0f}s")
            if all(rc is not None for _, rc in codes):
                break
            now = time.monotonic()
            if peers_deadline is not None and now > peers_deadline:
                self.stop()
                break
            if deadline is not None and now > deadline:
                self.say(f"timed out after {timeout_s:.0f}s; stopping every host")
                self.stop()
                return TIMEOUT_EXIT
            time.sleep(_POLL_S)
        self.join_output()
        if first_failure is None:
            return 0
        rc = first_failure[1]
        return 128 - rc if rc < 0 else rc

    def stop(self) -> None:
        """SIGTERM every host's process group, then SIGKILL what is left."""
        self.state = RunState.STOPPING
        for sig, grace in ((signal.SIGTERM, _TERM_GRACE_S), (signal.SIGKILL, 2.0)):
            live = [p for _, p in self.procs if p.poll() is None]
            for p in live:
                try:
                    os.killpg(p.pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass
            end = time.monotonic() + grace
            while any(p.poll() is None for p in live) and time.monotonic() < end:
                time.sleep(_POLL_S)
        self.join_output()

    def join_output(self) -> None:
        for t in self.threads:
            t.join(timeout=2.0)
        self.state = RunState.DONE


def run_cluster(opts: ClusterOptions, out: IO[str] = sys.stdout) -> int:
    """Build the network, run the job on every host, always tear everything down."""
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
    net = LocalNetwork(opts.num_nodes, opts.shaping)
    sup = _Supervisor(out, opts.fault, kill_host=lambda name: net.kill_host(next(h for h in net.hosts if h.name == name)))
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
        env = host_env(os.environ)
        rdzv_host = net.hosts[0].name
        for h in net.hosts:
            # The hosts share this machine's kernel, so discovery would see one node (see [Note: one
            # machine, one node] in hybridshard.topology.probe); name each host's node after it.
            host = dict(env, HYBRIDSHARD_NODE_NAME=h.name)
            sup.start(h.name, net.host_argv(h, launch_argv(opts, h.index, rdzv_host)), host)
        rc = sup.wait(opts.timeout_s)
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
        usage="local-cluster --nodes N --procs-per-node M [--inter-node-bandwidth RATE] [--latency DELAY] -- CMD...",
    )
    p.add_argument("--nodes", type=int, default=2, help="number of hosts (default 2)")
    p.add_argument("--procs-per-node", type=int, default=2, help="ranks per host (default 2)")
    p.add_argument("--inter-node-bandwidth", metavar="RATE", help="shape each host's link, e.g. 1gbit, 50mbit")
    p.add_argument("--latency", metavar="DELAY", help="one-way delay between hosts, e.g. 200us (needs netem)")
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
        )
    except ValueError as exc:
        print(f"local-cluster: error: {exc}", file=sys.stderr)
        return 2
    return run_cluster(opts)


if __name__ == "__main__":
    sys.exit(main())
