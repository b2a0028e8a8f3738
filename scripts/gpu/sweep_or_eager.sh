#!/usr/bin/env bash
# On the GPU machine: `run.sh sweep MODEL ARGS` with vLLM's CUDA graphs (the stack's default
# on a GPU), and if a stack does not start (vLLM 0.26's compile there has never been tried),
# the same sweep with --enforce-eager under PUSHKV_RUN_TAG=eager, in what is left of
# MAX_MINUTES. SERVER_ARGS: the servers' flags (default a 0.35 share of the GPU).
#   MAX_MINUTES=8.3 bash scripts/gpu/sweep_or_eager.sh llama8b --configs single push-ft ...
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pushkv-out}
model=$1
shift
server_args=${SERVER_ARGS:---gpu-memory-utilization 0.35}
max_minutes=${MAX_MINUTES:-8.3}
log=$OUT/sweep-$model${PUSHKV_RUN_TAG:+-$PUSHKV_RUN_TAG}.txt
start=$(date +%s)
bash scripts/gpu/run.sh sweep "$model" "$@" --server-args "$server_args" \
  --max-minutes "$max_minutes" &
pid=$!
while kill -0 "$pid" 2>/dev/null; do
  if grep -q "FAILED: stack did not start" "$log" 2>/dev/null; then
    echo "a stack did not start with CUDA graphs: the rest eager (PUSHKV_RUN_TAG=eager)"
    pkill -TERM -f "connector.cli bench --sweep"
    wait "$pid"
    left=$(python3 -c "print(round($max_minutes - ($(date +%s) - $start) / 60, 1))")
    PUSHKV_RUN_TAG=eager exec bash scripts/gpu/run.sh sweep "$model" "$@" \
      --server-args "$server_args --enforce-eager" --max-minutes "$left"
  fi
  sleep 3
done
wait "$pid"
