#!/bin/bash
# RL fine-tuning on machines without a scheduler: the trainer's processes on NNODES machines, started by
# torchrun (Lightning reads their ranks through TorchElasticEnvironment), rollouts from vLLM servers that
# lit-cancel serve starts on other machines, one per GPU. WEIGHTS_DIR must be a folder that the trainer
# machine of rank 0 can write and every server machine can read (NFS or the like).
#
# On each server machine (the servers keep running until stopped):
#   examples/torchrun/rl_with_vllm_servers.sh serve
# then on each trainer machine, the same line with NODE_RANK 0 .. NNODES-1:
#   NODE_RANK=0 MASTER_ADDR=trainer-0 SERVER_HOSTS="server-0 server-1" examples/torchrun/rl_with_vllm_servers.sh train
#
# Every machine needs lit_cancel installed and this repository's configs; the server machines also vLLM
# (pip install -e ".[vllm]"). A stopped run resumes from its last.ckpt: add --ckpt_path PATH to the fit line.
set -euo pipefail

CONFIG=${CONFIG:-configs/qwen2.5-0.5b-gsm8k-server.yaml}   # the fit config; the servers serve its model_path
GPUS_PER_NODE=${GPUS_PER_NODE:-8}             # trainer processes per trainer machine, servers per server machine
BASE_PORT=${BASE_PORT:-8000}                  # server k of a machine listens on BASE_PORT + k
NNODES=${NNODES:-2}                           # trainer machines
NODE_RANK=${NODE_RANK:-0}                     # this trainer machine: 0 on MASTER_ADDR, then 1 .. NNODES-1
MASTER_ADDR=${MASTER_ADDR:-localhost}         # the trainer machine of rank 0, as the others reach it
MASTER_PORT=${MASTER_PORT:-29500}             # a free port there
SERVER_HOSTS=${SERVER_HOSTS:-localhost}       # the server machines, separated by spaces
WEIGHTS_DIR=${WEIGHTS_DIR:-/shared/$USER/lit-cancel/weights}   # rank 0 writes each version here, every server reads it
STARTUP_SECONDS=${STARTUP_SECONDS:-1200}      # how long train waits for the servers' /health
LOG_DIR=${LOG_DIR:-logs}                      # the servers' output

case "${1:-}" in
  serve)
    mkdir -p "$LOG_DIR"
    for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
      CUDA_VISIBLE_DEVICES=$gpu lit-cancel serve --config "$CONFIG" --host 0.0.0.0 --port $((BASE_PORT + gpu)) \
        > "$LOG_DIR/server-$((BASE_PORT + gpu)).log" 2>&1 &
    done
    echo "$GPUS_PER_NODE vLLM servers starting on ports $BASE_PORT to $((BASE_PORT + GPUS_PER_NODE - 1)), output in $LOG_DIR/"
    wait
    ;;
  train)
    URLS=()
    for host in $SERVER_HOSTS; do
      for ((k = 0; k < GPUS_PER_NODE; k++)); do
        URLS+=("http://$host:$((BASE_PORT + k))")
      done
    done
    for url in "${URLS[@]}"; do
      until curl --silent --fail --max-time 5 "$url/health" > /dev/null; do
        if (( SECONDS > STARTUP_SECONDS )); then
          echo "$url/health did not answer within $STARTUP_SECONDS s: is '$0 serve' running there?" >&2
          exit 1
        fi
        sleep 5
      done
    done
    URL_LIST=$(printf '"%s", ' "${URLS[@]}")
    URL_LIST="[${URL_LIST%, }]"
    echo "vLLM servers answering: $URL_LIST"
    # --trainer.num_nodes and --trainer.devices must be torchrun's --nnodes and --nproc-per-node
    torchrun --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" --node-rank "$NODE_RANK" \
      --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --no-python \
      lit-cancel fit --config "$CONFIG" \
        --trainer.num_nodes "$NNODES" --trainer.devices "$GPUS_PER_NODE" \
        --model.init_args.engine.init_args.urls "$URL_LIST" \
        --model.init_args.engine.init_args.weights_dir "$WEIGHTS_DIR"
    ;;
  *)
    echo "usage: $0 serve | train (this file's first lines say where each one runs)" >&2
    exit 2
    ;;
esac
