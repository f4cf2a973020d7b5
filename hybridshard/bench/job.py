"""Start the benchmark's ranks: two (or more) torchrun agents on loopback, or ``launch/local-cluster``.

[Note: bench job]
On loopback, agent ``k`` runs ``hybridshard launch --nnodes N --node-rank k --nproc-per-node M
--master-addr 127.0.0.1 ...`` with ``HYBRIDSHARD_NODE_NAME=node<k>``, so topology discovery sees N
nodes and plans the shard groups inside each, as on a real cluster. With an inter-node bandwidth the
job runs on :mod:`hybridshard.launcher.local_cluster` instead: one network namespace per node, the
links shaped with ``tc``; that needs the rights to create namespaces (root), and the error says so.
Either way the hosts' output comes through a :class:`~hybridshard.bench.progress.ProgressSink`, which
draws rank 0's progress as one bar and passes every other line on to stderr.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from typing import Sequence

from hybridshard.bench.progress import ProgressSink
from hybridshard.launcher import local_cluster
from hybridshard.launcher.netns import Shaping, check_rights

logger = logging.getLogger(__name__)

__all__ = ["JobSpec", "run_job", "LOOPBACK"]

LOOPBACK = "127.0.0.1"
# Variables that would make an agent think it is already a rank, or on another node.
_RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR", "MASTER_PORT",
             "HYBRIDSHARD_NODE_NAME", "TORCHELASTIC_RUN_ID")


@dataclass(frozen=True)
class JobSpec:
    """How to start the ranks of one benchmark job."""

    num_nodes: int
    procs_per_node: int
    worker_argv: tuple[str, ...]
    """The program every rank runs (``python -m hybridshard bench --worker ...``)."""
    inter_node_bandwidth: str | None = None
    """A ``tc`` rate (``1gbit``, ``100mbit``): run on ``launch/local-cluster``; ``None``: loopback."""
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.procs_per_node < 1:
            raise ValueError(f"--nodes and --nproc-per-node must be >= 1, found {self.num_nodes} and "
                             f"{self.procs_per_node}")
        if self.inter_node_bandwidth is not None:
            Shaping(rate=self.inter_node_bandwidth)  # validates the rate


def _quiet_env(base: dict[str, str]) -> dict[str, str]:
    env = dict(base)
    env.setdefault("OMP_NUM_THREADS", "1")
    # c10d warns on every connection whose peer has no reverse DNS entry; the simulated hosts have none.
    env.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _loopback(spec: JobSpec, sink: ProgressSink) -> int:
    opts = local_cluster.ClusterOptions(spec.num_nodes, spec.procs_per_node, spec.worker_argv, port=local_cluster.free_port(LOOPBACK))
    base = _quiet_env({k: v for k, v in os.environ.items() if k not in _RANK_ENV and not k.startswith("SLURM_")})
    # The local-cluster supervisor starts, streams and stops the agents the same way on loopback.
    sup = local_cluster._Supervisor(sink)
    try:
        for k in range(spec.num_nodes):
            env = dict(base, HYBRIDSHARD_NODE_NAME=f"node{k}")
            sup.start(f"node{k}", local_cluster.launch_argv(opts, k, LOOPBACK), env)
        return sup.wait(spec.timeout_s)
    finally:
        sup.stop()


def _netns(spec: JobSpec, sink: ProgressSink) -> int:
    reason = check_rights()
    if reason is not None:
        raise PermissionError(
            f"--inter-node-bandwidth runs the job on launch/local-cluster, which needs the rights to create "
            f"network namespaces (root: CAP_SYS_ADMIN and CAP_NET_ADMIN), and this process cannot: {reason}. "
            "Run as root, or drop --inter-node-bandwidth to benchmark on loopback"
        )
    opts = local_cluster.ClusterOptions(
        spec.num_nodes, spec.procs_per_node, spec.worker_argv,
        shaping=Shaping(rate=spec.inter_node_bandwidth), timeout_s=spec.timeout_s,
    )
    saved = dict(os.environ)
    os.environ.update(_quiet_env(dict(os.environ)))  # run_cluster gives the hosts this process's environment
    try:
        return local_cluster.run_cluster(opts, out=sink)
    finally:
        os.environ.clear()
        os.environ.update(saved)


def run_job(spec: JobSpec, stream=None) -> int:
    """Run every rank to the end; returns the first failure's exit status (0 when all succeeded)."""
    sink = ProgressSink(stream or sys.stderr)
    try:
        return (_netns if spec.inter_node_bandwidth else _loopback)(spec, sink)
    finally:
        sink.close()


def worker_command(args: Sequence[str]) -> tuple[str, ...]:
    """``python -m hybridshard bench --worker --from-job ARGS``: what every rank runs."""
    return (sys.executable, "-m", "hybridshard", "bench", "--worker", "--from-job", *args)
