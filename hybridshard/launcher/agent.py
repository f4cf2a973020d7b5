"""``python -m hybridshard.launcher.agent TORCHRUN-ARGS``: torchrun, leaving the node's record of the run.

[Note: the node record]
This is torchrun (``torch.distributed.run``: its parser, ``config_from_args`` and ``elastic_launch``)
run in this process with two additions, both through torch's own extension points:

- the logs specs are :class:`RecordingLogsSpecs`, torch's ``DefaultLogsSpecs`` which, when it lays out
  an attempt's files, also notes which global rank each local rank is and where its files are;
- the ``ChildFailedError`` torchrun ends with (every failed rank of this node: exit code or signal,
  error file, time) is written down instead of printed as a banner.

Both go to ``node.json`` in this node's log directory (see [Note: run directory] in :mod:`.runlog`),
which the launcher reads after this process exits. A new attempt (``--max-restarts``) prints one line:
restart k of N, which rank failed and how.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import sys
import time

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs, Std
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

from hybridshard.launcher.runlog import NODE_RECORD, last_output, read_error_file, traceback_from_log, write_json

logger = logging.getLogger(__name__)

__all__ = ["RecordingLogsSpecs", "ANNOUNCE", "RANK_PREFIX_TEMPLATE", "main", "node_name"]

ANNOUNCE = "[hybridshard] "
"""Prefix of this process's own console lines (the launcher shows them; torchrun's go to its log)."""
RANK_PREFIX_TEMPLATE = "[rank${rank}] "
"""The prefix of the ranks' lines torchrun tees to the console (unless TORCHELASTIC_LOG_LINE_PREFIX_TEMPLATE)."""


def node_name() -> str:
    return os.environ.get("HYBRIDSHARD_NODE_NAME") or socket.gethostname()


def exit_text(exitcode: int) -> str:
    if exitcode < 0:
        try:
            return f"killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"killed by signal {-exitcode}"
    return f"exit code {exitcode}"


class _FailureLog(logging.Handler):
    """Keeps torchrun's "failed (exitcode: X) local_rank: L" records (the first failure of an attempt)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.seen: list[tuple[float, int, int]] = []

    def emit(self, record: logging.LogRecord) -> None:
        if str(record.msg).startswith("failed (exitcode") and isinstance(record.args, tuple) and len(record.args) >= 2:
            self.seen.append((record.created, int(record.args[0]), int(record.args[1])))


class RecordingLogsSpecs(DefaultLogsSpecs):
    """torch's per-rank log layout, noted in ``node.json``; see [Note: the node record]."""

    def __init__(self, *args, record_dir: str, max_restarts: int, failures: _FailureLog, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.record_dir = record_dir
        self.record = {"node": node_name(), "node_rank": None, "max_restarts": max_restarts, "attempts": [],
                       "restarts": [], "failures": [], "result": "running", "started": time.time()}
        self.failures = failures

    def reify(self, envs):
        dest = super().reify(envs)
        attempt = int(envs[0].get("TORCHELASTIC_RESTART_COUNT", "0")) if envs else 0
        self.record["node_rank"] = int(envs[0]["GROUP_RANK"]) if envs else None
        ranks = [{"rank": int(env["RANK"]), "local_rank": local, "stdout": dest.stdouts.get(local) or None,
                  "stderr": dest.stderrs.get(local) or None, "error_file": dest.error_files.get(local)}
                 for local, env in sorted(envs.items())]
        previous = self.record["attempts"][-1] if self.record["attempts"] else None
        if previous is not None:
            self._announce_restart(attempt, previous)
        self.record["attempts"].append({"attempt": attempt, "started": time.time(), "ranks": ranks})
        self.save()
        return dest

    def _announce_restart(self, attempt: int, previous: dict) -> None:
        by_local = {r["local_rank"]: r for r in previous["ranks"]}
        seen = [s for s in self.failures.seen if s[0] >= previous["started"]]
        if seen:
            _, exitcode, local = seen[0]
            rank = by_local.get(local, {})
            why = exit_text(exitcode)
            err = read_error_file(rank.get("error_file"))
            if err is not None:
                why += ": " + err.message.splitlines()[0]
            elif exitcode > 0 and traceback_from_log(rank.get("stderr")) is not None:
                why += ": " + traceback_from_log(rank.get("stderr"))[1]
            elif last_output(rank.get("stdout"), rank.get("stderr")):
                why += "; last output: " + last_output(rank.get("stdout"), rank.get("stderr"))
            text = f"rank {rank.get('rank', '?')} ({self.record['node']}, local rank {local}) {why}"
        else:
            text = "another node's workers failed (this node's all ran)"
        entry = {"attempt": attempt, "text": text, "time": time.time()}
        self.record["restarts"].append(entry)
        print(f"{ANNOUNCE}restart {attempt} of {self.record['max_restarts']} on {self.record['node']}: {text}",
              file=sys.stderr, flush=True)

    def save(self) -> None:
        os.makedirs(self.record_dir, exist_ok=True)
        write_json(os.path.join(self.record_dir, NODE_RECORD), self.record)


def _local_ranks(text: str | None) -> set[int] | None:
    if not text:
        return None
    try:
        return {int(x) for x in text.split(",")}
    except ValueError:
        raise ValueError(f"--local-ranks-filter must be comma-separated integers, found {text!r}") from None


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(sys.argv[1:] if argv is None else argv)
    if not args.log_dir:
        raise ValueError("hybridshard.launcher.agent needs torchrun's --log-dir (the node's run directory)")
    config, cmd, cmd_args = torchrun.config_from_args(args)
    os.environ.setdefault("HYBRIDSHARD_RUN_DIR", args.log_dir)  # the ranks' straggler report goes there
    failures = _FailureLog()
    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addHandler(failures)
    specs = RecordingLogsSpecs(log_dir=args.log_dir, redirects=Std.from_str(args.redirects), tee=Std.from_str(args.tee),
                               local_ranks_filter=_local_ranks(args.local_ranks_filter),
                               record_dir=args.log_dir, max_restarts=args.max_restarts, failures=failures)
    config.logs_specs = specs
    config.log_line_prefix_template = config.log_line_prefix_template or RANK_PREFIX_TEMPLATE
    status = 0
    try:
        elastic_launch(config=config, entrypoint=cmd)(*cmd_args)
        specs.record["result"] = "succeeded"
    except ChildFailedError as exc:
        specs.record["result"] = "failed"
        started = specs.record["attempts"][-1]["started"] if specs.record["attempts"] else 0.0
        # torchrun's timestamps are whole seconds; its log record of the first failure is finer.
        seen = {local: t for t, _, local in reversed(failures.seen) if t >= started}
        specs.record["failures"] = [
            {"rank": rank, "local_rank": f.local_rank, "exitcode": f.exitcode,
             "time": seen.get(f.local_rank, float(f.timestamp)),
             "error_file": None if f.error_file == "<N/A>" else f.error_file}
            for rank, f in sorted(exc.failures.items())
        ]
        print(str(exc), file=sys.stderr, flush=True)  # torchrun's banner, for torchrun.log
        status = 1
    except BaseException:
        specs.record["result"] = "interrupted"
        raise
    finally:
        specs.record["ended"] = time.time()
        specs.save()
    return status


if __name__ == "__main__":
    sys.exit(main())
