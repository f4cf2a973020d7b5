#!/usr/bin/env bash
# Run once on every node of a multi-node job (same command everywhere, NODE_RANK differs):
#   NNODES=2 NODE_RANK=0 MASTER_ADDR=gpu07 launch/multinode.sh examples/train_gpt.py --steps 100   # on gpu07
#   NNODES=2 NODE_RANK=1 MASTER_ADDR=gpu07 launch/multinode.sh examples/train_gpt.py --steps 100   # on gpu08
# Node rank K owns global ranks K*NPROC_PER_NODE .. (K+1)*NPROC_PER_NODE-1; see docs/launching.md.
set -euo pipefail

NNODES="${NNODES:-1}"
NODE_RANK="${NODE_RANK:-0}"
MASTER_ADDR="${MASTER_ADDR:-127.0.0.1}"     # the node with NODE_RANK=0; every node must reach it
MASTER_PORT="${MASTER_PORT:-29500}"
NPROC_PER_NODE="${NPROC_PER_NODE:-}"        # empty: one process per visible GPU (1 without GPUs)
PYTHON="${PYTHON:-python3}"
EXTRA_LAUNCH_ARGS="${EXTRA_LAUNCH_ARGS:-}"  # e.g. "--bind-numa --max-restarts 0"

# NCCL settings worth knowing; uncomment and adapt to the fabric.
# export NCCL_SOCKET_IFNAME=eth0            # interface for bootstrap / socket transport
# export NCCL_IB_HCA=mlx5_0,mlx5_1          # InfiniBand / RoCE adapters to use
# export NCCL_IB_GID_INDEX=3                # RoCE v2 GID index
# export NCCL_NET_GDR_LEVEL=PHB             # GPUDirect RDMA up to this PCI distance
# export NCCL_DEBUG=INFO                    # print the transports NCCL picked
# export NCCL_DEBUG_SUBSYS=INIT,NET
# export GLOO_SOCKET_IFNAME=eth0            # gloo (CPU) collectives and object gathers

if [[ $# -lt 1 ]]; then
  echo "usage: NNODES=N NODE_RANK=K MASTER_ADDR=HOST $0 SCRIPT [ARGS...]" >&2
  exit 2
fi

args=(--nnodes "$NNODES" --node-rank "$NODE_RANK" --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
if [[ -n "$NPROC_PER_NODE" ]]; then
  args+=(--nproc-per-node "$NPROC_PER_NODE")
fi
# shellcheck disable=SC2206
extra=($EXTRA_LAUNCH_ARGS)
exec "$PYTHON" -m hybridshard launch "${args[@]}" "${extra[@]}" -- "$@"
