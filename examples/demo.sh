#!/usr/bin/env bash
# The main job: a simulated cluster of 2 nodes x 2 ranks on this one machine.
#
#   1. this node's topology report;
#   2. the cluster view and group plan, gathered from every rank of the 2-node job;
#   3. a small GPT trained with HYBRID_SHARD on that job, loss and tokens/s per step, saving sharded
#      checkpoints; one rank is killed half-way, and the job is launched again and resumes from the
#      latest checkpoint.
#
# The nodes are real separate hosts (network namespaces with their own hostnames, through
# launch/local-cluster) where this machine allows it, and two torchrun agents on this host that
# report different node names (HYBRIDSHARD_NODE_NAME) otherwise. Usage:
#   bash examples/demo.sh [--steps N] [--strategy NAME] [--no-netns]
set -euo pipefail
cd "$(dirname "$0")/.."

STEPS=10
STRATEGY=HYBRID_SHARD
NO_NETNS=
while [ $# -gt 0 ]; do
    case "$1" in
        --steps) STEPS="$2"; shift 2 ;;
        --strategy) STRATEGY="$2"; shift 2 ;;
        --no-netns) NO_NETNS=1; shift ;;
        *) echo "demo: unknown option $1 (expected --steps N, --strategy NAME or --no-netns)" >&2; exit 2 ;;
    esac
done

NODES=2
PROCS=2
PY="${PYTHON:-python3}"
export OMP_NUM_THREADS=1
# c10d warns on every connection whose peer address has no reverse DNS entry; the demo's hosts have none.
export TORCH_CPP_LOG_LEVEL="${TORCH_CPP_LOG_LEVEL:-ERROR}"
# Progress bars are for terminals; teed through the launcher they are only noise (the rank logs keep all).
export TQDM_DISABLE="${TQDM_DISABLE:-1}" HF_HUB_DISABLE_PROGRESS_BARS="${HF_HUB_DISABLE_PROGRESS_BARS:-1}"

say() { printf '\n== %s\n' "$*"; }

# Every job's full output, one file per rank, under $RUNS/<job>/node<K>/ (see docs/launching.md).
RUNS="${DEMO_LOGS:-hybridshard-logs/demo-$(date +%Y%m%d-%H%M%S)}"

# Run "$@" as a job of $NODES nodes x $PROCS ranks; its logs go to $RUNS/$JOB.
on_cluster() {
    if [ -n "${USE_NETNS:-}" ]; then
        launch/local-cluster --nodes "$NODES" --procs-per-node "$PROCS" --timeout 600 --log-dir "$RUNS/$JOB" -- "$@"
    else
        local port=$((29600 + RANDOM % 200)) pids=() status=0
        for ((k = 0; k < NODES; k++)); do
            # node 0 prints the summary of a failed job, merged from every node's record
            HYBRIDSHARD_NODE_NAME="node$k" "$PY" -m hybridshard launch --nnodes "$NODES" --node-rank "$k" \
                --nproc-per-node "$PROCS" --master-addr 127.0.0.1 --master-port "$port" --log-dir "$RUNS/$JOB" \
                $([ "$k" -gt 0 ] && echo --no-summary) -- "$@" 2>&1 | sed -u "s/^/[node$k] /" &
            pids+=($!)
        done
        for pid in "${pids[@]}"; do wait "$pid" || status=$?; done
        return "$status"
    fi
}

say "1/4  this node: hybridshard topo"
"$PY" -m hybridshard topo || true   # warnings about this host must not stop the demo

if [ -z "$NO_NETNS" ] && launch/local-cluster --check; then
    USE_NETNS=1
    how="launch/local-cluster: $NODES network-namespace hosts x $PROCS ranks"
else
    USE_NETNS=
    how="two torchrun agents on this host acting as nodes node0, node1 (x $PROCS ranks)"
fi

say "2/4  cluster view and group plan, via $how"
JOB=topo on_cluster "$PY" -m hybridshard topo --cluster

CKPT="$(mktemp -d)/ckpt"
KILL_AT=$((STEPS / 2 + 1))
say "3/4  training a small GPT with $STRATEGY for $STEPS steps, via $how; rank 3 is killed at step $KILL_AT"
JOB=train on_cluster examples/train_gpt.py --steps "$STEPS" --strategy "$STRATEGY" --timeout-s 60 \
    --checkpoint-dir "$CKPT" --save-every 2 --resume --kill-rank 3 --kill-at-step "$KILL_AT" \
    || echo "(as planned: rank 3 was killed; every rank's full output is in $RUNS/train)"

say "3/4  the same job again, resuming from the latest checkpoint: $(ls "$CKPT" | grep -v '\.' | tail -1)"
JOB=resume on_cluster examples/train_gpt.py --steps "$STEPS" --strategy "$STRATEGY" --timeout-s 60 \
    --checkpoint-dir "$CKPT" --save-every 2 --resume --check-replicas-every 2
rm -rf "$(dirname "$CKPT")"

FT="$(mktemp -d)"
say "4/4  a pretrained Llama that no rank builds whole: meta init, safetensors read into the shards, train, export"
JOB=llama on_cluster examples/finetune_llama.py --workdir "$FT"
rm -rf "$FT"

say "done: every job's output, one file per rank, in $RUNS"
