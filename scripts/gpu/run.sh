#!/usr/bin/env bash
# On the GPU machine, one call of the `device` tool each (scripts/gpu/README.md):
#   bash scripts/gpu/run.sh receive            # a part of the site came with this call
#   bash scripts/gpu/run.sh check [MODEL]      # + unpack, model, P/D greedy check
#   bash scripts/gpu/run.sh sweep MODEL ARGS   # pushkv bench --sweep on this GPU
#   bash scripts/gpu/run.sh cost [ARGS]        # transfer cost per GPU model's KV (no vLLM)
# PUSHKV_RUN_TAG=x names a second sweep's folder (/tmp/sweep-MODEL-x) beside the first.
# Every step writes its log and results under $OUT (what comes back).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/pushkv-out}
mkdir -p "$OUT"
step=${1:-receive}
shift || true
bash scripts/gpu/receive.sh || exit 1
[ "$step" = receive ] && exit 0
[ -f "${PUSHKV_GPU_DIR:-/tmp/pushkv-gpu}/site/.complete" ] || { echo "site not complete"; exit 1; }
. scripts/gpu/env.sh
if [ "$step" = cost ]; then  # P/D rank pairs with each GPU model's KV: no model, no vLLM
  python3 -m bench.gpu_model_cost --device cuda:0 --out "$OUT/model_cost.json" "$@" 2>&1 \
    | tee "$OUT/model_cost.txt"
  exit "${PIPESTATUS[0]}"
fi
MODELS=/tmp/models
model=${1:-llama8b}
shift || true
python3 -m bench.gpu_model "$model" "$MODELS" | tee "$OUT/model.txt" || exit 1
git_rev=${PUSHKV_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
{
  echo "commit $git_rev (+ working tree), $(date -u +%FT%TZ)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
  python3 -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)'
} > "$OUT/machine.txt" 2>&1
cat "$OUT/machine.txt"
case "$step" in
  check)
    python3 -m bench.gpu_serve_check --model "$MODELS/$model" --out /tmp/check-$model "$@" \
      2>&1 | tee "$OUT/check-$model.txt"
    rc=${PIPESTATUS[0]}
    cp /tmp/check-$model/check.json "$OUT/check-$model.json" 2>/dev/null
    tar -C /tmp -czf "$OUT/check-$model-logs.tgz" "check-$model" 2>/dev/null
    exit $rc
    ;;
  sweep)
    name=sweep-$model${PUSHKV_RUN_TAG:+-$PUSHKV_RUN_TAG}
    run_dir=/tmp/$name
    python3 -m connector.cli bench --sweep --model "$MODELS/$model" --gpus 0 0 --no-pin-servers \
      --run-dir "$run_dir" "$@" 2>&1 | tee -a "$OUT/$name.txt"
    rc=${PIPESTATUS[0]}
    tar -C /tmp -czf "$OUT/$name.tgz" "$name" 2>/dev/null
    exit $rc
    ;;
esac
