#!/usr/bin/env bash
# On the GPU machine, after the site is complete: which UCX transports carry VRAM between two
# processes of the one GPU. (1) pushkv's transport bench (WRITE) with UCX's protocol report;
# (2) vLLM's NixlConnector (a READ from D) at 4096 tokens, where UCX chose "software
# emulation" over tcp/lo (bench/results/gpu-20261206-h100/pull), with UCX's log at
# PULL_UCX_LOG (info); the stack turns cuda_ipc's GET on (UCX_CUDA_IPC_ENABLE_GET_ZCOPY=on,
# set it to auto to see UCX's default). tcp stays in UCX_TLS: without it NIXL's UCX backend fails at start on this
# machine (bench/results/gpu-20261206b-h100). UCX's choices come back under $OUT/ucx-*.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pushkv-out}
mkdir -p "$OUT"
. scripts/gpu/env.sh
for tls in tcp,sm,self,cuda_copy,cuda_ipc; do
  UCX_PROTO_INFO=y timeout 120 python3 -m bench.transport_bench --device cuda --ucx-tls "$tls" \
    --sizes 64 --pieces 64 --reps 3 --ping-reps 20 > "$OUT/ucx-bench-$tls.txt" 2>&1
  echo "transport_bench $tls rc=$?"; grep -E "contiguous|cuda_ipc|cuda_copy|tcp|emulation" \
    "$OUT/ucx-bench-$tls.txt" | head -20
done
tls=${PULL_TLS:-tcp,sm,self,cuda_copy,cuda_ipc}
PUSHKV_GPU_UCX_TLS=$tls UCX_PROTO_INFO=y UCX_LOG_LEVEL=${PULL_UCX_LOG:-info} PUSHKV_RUN_TAG=pull bash scripts/gpu/run.sh sweep llama8b \
  --configs vllm-pull --lengths 4096 --rates 1 --point-s 6 \
  --server-args "--gpu-memory-utilization 0.35" --kv-cache-bytes 8589934592 --max-minutes 4
echo "pull rc=$?"
grep -rhE "ucp_get|ucp_put|cuda_ipc|emulation|no .*transport|unreachable" /tmp/sweep-llama8b-pull \
  2>/dev/null | sort | uniq -c | sort -rn | head -60 | tee "$OUT/ucx-pull-$tls.txt"
