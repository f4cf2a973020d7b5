"""Resolve where this node sits in the job: options > SLURM > defaults.

[Note: rendezvous]
By default the launcher uses torchrun's *static* rendezvous: the agent with node rank 0 hosts a c10d
TCP store on the first host (``--master-addr``/``--master-port``), every agent connects to it, and
node rank ``K`` owns global ranks ``K*M .. K*M+M-1`` (``M`` processes per node). Node ranks are
therefore exactly ``--node-rank`` or ``SLURM_NODEID``. With ``--rdzv-backend c10d`` the store lives at
``--rdzv-endpoint`` and torchrun's elastic rendezvous assigns node ranks itself (sorted by agent
address), so ``--node-rank`` is not passed; planning does not care either way, because groups are
built from the nodes ranks *report*, not from rank arithmetic.
A one-node job with no rendezvous given uses a c10d store on a free local port, as plain torchrun does.

[Note: restarts]
``--max-restarts N`` (and an elastic ``--nnodes MIN:MAX``, whose membership changes restart every
worker too) needs two things the default rendezvous does not give:

* Every agent must restart its workers, not only the one whose worker died. With ``static`` nothing
  tells the others, and agents restart at unrelated times, each on its own count. With ``c10d`` the
  restarting agent joins a new round and the others see it and restart too (not counting it as one
  of theirs: ``TORCHELASTIC_RESTART_COUNT`` is per agent, not job-wide, so nothing such as resuming
  may depend on it). So restarts need ``c10d``; ``static`` with restarts is an error.
* Restarted workers must not read the previous attempt's keys. Under torchrun every worker uses the
  agent's TCP store, and this torch gives attempts neither a key prefix nor a new store, so gloo's
  connect finds the old attempt's addresses ("connection refused", or the other node's live old
  workers). With ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` (set by the launcher whenever workers can
  restart) ``c10d`` publishes a new port every round and rank 0's worker hosts a new, empty store.
  The cost: that store lives in rank 0's process, so when rank 0 dies its peers cannot read each
  other's fault reports ([Note: naming the lost rank] in ``hybridshard/runtime/faults/errors.py``).
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from enum import Enum
from typing import Callable, Mapping

from hybridshard.launcher.slurm import SlurmEnv, slurm_from_env

logger = logging.getLogger(__name__)

__all__ = ["Source", "LaunchOptions", "LaunchSettings", "resolve_settings", "DEFAULT_PORT", "FRESH_STORE_ENV",
           "NCCL_FAULT_DEFAULTS"]

DEFAULT_PORT = 29500
_SLURM_PORT_SPAN = 1000
_LOCAL_HOST = "127.0.0.1"
FRESH_STORE_ENV = ("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
"""Set for torchrun when workers can restart: a new store for every attempt (see [Note: restarts])."""

NCCL_FAULT_DEFAULTS = (
    ("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3"),
    ("TORCH_NCCL_DUMP_ON_TIMEOUT", "1"),
    ("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000"),
)
"""Set for the workers unless the environment sets them already; see [Note: NCCL faults].

[Note: NCCL faults]
On NCCL a failed or timed-out collective is found by the process group's watchdog thread, not by the
Python code that issued it (``wait()`` returns at once; see [Note: stream executor] in
``hybridshard/runtime/comm/executors/streams.py``), so no error is raised where the collective was issued. The
runtime's watchdog names the lost rank from the job's store once a collective has been stuck for
``HYBRIDSHARD_FAULT_SECONDS`` and stops the process (see [Note: a stuck collective with a lost peer] in
``hybridshard/runtime/faults/errors.py``). The launcher makes every other failure end the job promptly and
leave evidence: ``TORCH_NCCL_ASYNC_ERROR_HANDLING=3`` makes the watchdog stop the process on a
timeout or a peer's failure without a communicator abort that could itself hang (torchrun's agent
then stops or restarts every worker), and ``TORCH_NCCL_DUMP_ON_TIMEOUT=1`` with a trace buffer of the
last 2000 collectives per rank writes NCCL's flight record (``/tmp/nccl_trace_rank_<rank>`` unless
``TORCH_NCCL_DEBUG_INFO_TEMP_FILE`` says otherwise), which names where each rank stopped. The
timeout itself is the job's ``init_process_group(timeout=...)`` (``examples/train_gpt.py
--timeout-s``; torch's default for NCCL is 10 minutes); the runtime's hang report
(``HYBRIDSHARD_HANG_SECONDS``, 300 s) comes before it. Variables the user set are left alone.
"""


class Source(str, Enum):
    """Where a resolved setting came from (shown by ``--dry-run``)."""

    OPTION = "option"
    SLURM = "slurm"
    GPUS = "visible GPUs"
    RESTARTS = "max-restarts"
    DEFAULT = "default"


@dataclass(frozen=True)
class LaunchOptions:
    """What the user passed; ``None`` means "not given"."""

    nnodes: str | None = None
    """An integer, or ``MIN:MAX`` for an elastic job (needs ``rdzv_backend="c10d"``)."""
    node_rank: int | None = None
    nproc_per_node: str | None = None
    """An integer or one of torchrun's words (``auto``, ``gpu``, ``cpu``)."""
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    """``HOST`` or ``HOST:PORT``."""
    rdzv_id: str | None = None
    master_addr: str | None = None
    master_port: int | None = None
    max_restarts: int | None = None
    """torchrun's ``--max-restarts``; above 0 it needs the ``c10d`` rendezvous (see [Note: restarts])."""


@dataclass(frozen=True)
class LaunchSettings:
    """The resolved settings of this node's torchrun agent."""

    nnodes: str
    node_rank: int
    """Passed to torchrun only with the static rendezvous; with ``c10d`` the rendezvous assigns it."""
    nproc_per_node: str
    rdzv_backend: str
    rdzv_host: str
    rdzv_port: int
    rdzv_id: str | None
    sources: tuple[tuple[str, Source], ...]
    """``(setting, source)`` for each setting, in a fixed order."""
    slurm_job_id: str | None = None
    max_restarts: int | None = None

    @property
    def restartable(self) -> bool:
        """True when torchrun may start this node's workers more than once (see [Note: restarts])."""
        return (self.max_restarts or 0) > 0 or ":" in self.nnodes

    def worker_env(self) -> list[tuple[str, str]]:
        """Variables torchrun needs on top of the inherited environment."""
        return [FRESH_STORE_ENV] if self.restartable and self.rdzv_backend != "static" else []

    @property
    def rdzv_endpoint(self) -> str:
        host = f"[{self.rdzv_host}]" if ":" in self.rdzv_host else self.rdzv_host
        return f"{host}:{self.rdzv_port}"

    @property
    def node_rank_fixed(self) -> bool:
        """True when this node's rank is known before the rendezvous (static, or a one-node job)."""
        return self.rdzv_backend == "static" or self.nnodes == "1"

    @property
    def nproc_int(self) -> int | None:
        return int(self.nproc_per_node) if self.nproc_per_node.isdigit() else None

    def source_of(self, name: str) -> Source:
        return dict(self.sources)[name]

    def torchrun_args(self) -> list[str]:
        """The rendezvous and size options of the torchrun command line."""
        args = ["--nnodes", self.nnodes]
        if self.rdzv_backend == "static":
            args += ["--node-rank", str(self.node_rank)]
        args += ["--nproc-per-node", self.nproc_per_node, "--rdzv-backend", self.rdzv_backend]
        if self.rdzv_backend == "static":
            args += ["--master-addr", self.rdzv_host, "--master-port", str(self.rdzv_port)]
        else:
            args += ["--rdzv-endpoint", self.rdzv_endpoint]
            if self.rdzv_id is not None:
                args += ["--rdzv-id", self.rdzv_id]
        if self.max_restarts is not None:
            args += ["--max-restarts", str(self.max_restarts)]
        return args


def _split_endpoint(endpoint: str) -> tuple[str, int | None]:
    text = endpoint.strip()
    if text.startswith("["):  # [v6::addr]:port
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    elif text.count(":") == 1:
        host, _, port_text = text.partition(":")
    else:
        host, port_text = text, ""
    if not host:
        raise ValueError(f"--rdzv-endpoint {endpoint!r} has no host; expected HOST or HOST:PORT, e.g. gpu07:29500")
    if not port_text:
        return host, None
    if not port_text.isdigit() or not 0 <= int(port_text) <= 65535:
        raise ValueError(f"--rdzv-endpoint {endpoint!r}: port {port_text!r} is not 0..65535")
    return host, int(port_text)


def _check_nnodes(nnodes: str, backend: str) -> int | None:
    lo, sep, hi = nnodes.partition(":")
    try:
        lo_n, hi_n = int(lo), int(hi) if sep else int(lo)
    except ValueError:
        raise ValueError(f"--nnodes must be N or MIN:MAX, found {nnodes!r}") from None
    if lo_n < 1 or hi_n < lo_n:
        raise ValueError(f"--nnodes {nnodes!r} is not a valid count (need 1 <= MIN <= MAX)")
    if sep and backend == "static":
        raise ValueError(f"--nnodes {nnodes} is elastic; elastic jobs need --rdzv-backend c10d and --rdzv-endpoint")
    return None if sep else lo_n


def slurm_port(job_id: str) -> int:
    """A port derived from the job id, so two jobs sharing a first host do not collide."""
    return DEFAULT_PORT + zlib.crc32(job_id.encode()) % _SLURM_PORT_SPAN


def resolve_settings(
    options: LaunchOptions,
    env: Mapping[str, str],
    *,
    count_gpus: Callable[[], int],
    slurm: SlurmEnv | None | bool = True,
) -> LaunchSettings:
    """Resolve every setting; see [Note: rendezvous]. ``slurm=True`` reads SLURM from ``env``."""
    job = slurm_from_env(env) if slurm is True else (slurm or None)
    sources: dict[str, Source] = {}
    restarts = options.max_restarts
    if restarts is not None and restarts < 0:
        raise ValueError(f"--max-restarts must be 0 or more, found {restarts}")
    if restarts and options.rdzv_backend == "static":
        raise ValueError(
            f"--max-restarts {restarts} needs the c10d rendezvous, found --rdzv-backend static: a static "
            "rendezvous restarts one node's workers alone, on the previous attempt's store; drop "
            "--rdzv-backend static (c10d is then used) or pass --rdzv-backend c10d"
        )
    if options.rdzv_backend:
        backend, sources["rdzv_backend"] = options.rdzv_backend, Source.OPTION
    elif restarts:
        backend, sources["rdzv_backend"] = "c10d", Source.RESTARTS
    else:
        backend, sources["rdzv_backend"] = "static", Source.DEFAULT

    if options.nnodes is not None:
        nnodes, sources["nnodes"] = options.nnodes, Source.OPTION
    elif job is not None:
        nnodes, sources["nnodes"] = str(job.num_nodes), Source.SLURM
    else:
        nnodes, sources["nnodes"] = "1", Source.DEFAULT
    fixed_nodes = _check_nnodes(nnodes, backend)

    if options.node_rank is not None:
        node_rank, sources["node_rank"] = options.node_rank, Source.OPTION
    elif job is not None:
        node_rank, sources["node_rank"] = job.node_id, Source.SLURM
    else:
        node_rank, sources["node_rank"] = 0, Source.DEFAULT
    if node_rank < 0 or (fixed_nodes is not None and node_rank >= fixed_nodes):
        raise ValueError(f"--node-rank {node_rank} is outside 0..{(fixed_nodes or 1) - 1} for --nnodes {nnodes}")

    if options.nproc_per_node is not None:
        nproc, sources["nproc_per_node"] = options.nproc_per_node, Source.OPTION
        if not (nproc.isdigit() and int(nproc) >= 1) and nproc not in ("auto", "gpu", "cpu", "xpu"):
            raise ValueError(f"--nproc-per-node must be a positive integer or auto/gpu/cpu, found {nproc!r}")
    else:
        gpus = count_gpus()
        nproc, sources["nproc_per_node"] = (str(gpus), Source.GPUS) if gpus > 0 else ("1", Source.DEFAULT)

    endpoint_host, endpoint_port = (None, None)
    if options.rdzv_endpoint is not None:
        endpoint_host, endpoint_port = _split_endpoint(options.rdzv_endpoint)
    if options.master_addr is not None:
        if endpoint_host is not None and endpoint_host != options.master_addr:
            raise ValueError(
                f"--rdzv-endpoint host {endpoint_host!r} and --master-addr {options.master_addr!r} disagree; pass one"
            )
        endpoint_host = options.master_addr
    if options.master_port is not None:
        endpoint_port = options.master_port
    if endpoint_port is not None and not 0 <= endpoint_port <= 65535:
        raise ValueError(f"rendezvous port {endpoint_port} is not 0..65535")

    rdzv_id = options.rdzv_id
    sources["rdzv_id"] = Source.OPTION if rdzv_id else Source.DEFAULT
    if endpoint_host is not None:
        host, sources["rdzv_host"] = endpoint_host, Source.OPTION
    elif job is not None:
        host, sources["rdzv_host"] = job.first_host, Source.SLURM
    elif fixed_nodes == 1:
        host, sources["rdzv_host"] = _LOCAL_HOST, Source.DEFAULT
    else:
        raise ValueError(
            f"--nnodes {nnodes} needs a rendezvous host that every node can reach: pass "
            "--rdzv-endpoint HOST:PORT (the first node's address), or run under SLURM"
        )
    if endpoint_port is not None:
        port, sources["rdzv_port"] = endpoint_port, Source.OPTION
    elif job is not None:
        port, sources["rdzv_port"] = slurm_port(job.job_id), Source.SLURM
    elif fixed_nodes == 1 and endpoint_host is None and options.rdzv_backend is None:
        # One node, nothing given: a c10d store on a free port, as plain torchrun does.
        backend, port, rdzv_id = "c10d", 0, rdzv_id or "standalone"
        sources["rdzv_port"] = Source.DEFAULT
    else:
        port, sources["rdzv_port"] = DEFAULT_PORT, Source.DEFAULT
    if backend != "static" and rdzv_id is None:
        rdzv_id = job.job_id if job is not None else "hybridshard"
        sources["rdzv_id"] = Source.SLURM if job is not None else Source.DEFAULT
    if backend != "static" and options.node_rank is not None:
        why = f"--max-restarts {restarts} uses" if sources["rdzv_backend"] is Source.RESTARTS else "with"
        logger.warning("--node-rank is ignored: %s the %s rendezvous, which assigns node ranks", why, backend)
    settings = LaunchSettings(
        nnodes=nnodes,
        node_rank=node_rank,
        nproc_per_node=nproc,
        rdzv_backend=backend,
        rdzv_host=host,
        rdzv_port=port,
        rdzv_id=rdzv_id,
        sources=tuple((k, sources[k]) for k in
                      ("nnodes", "node_rank", "nproc_per_node", "rdzv_backend", "rdzv_host", "rdzv_port", "rdzv_id")),
        slurm_job_id=job.job_id if job is not None else None,
        max_restarts=restarts,
    )
    logger.debug("launch settings: %s", settings)
    return settings
