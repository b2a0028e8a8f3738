# Source on the GPU machine after scripts/gpu/receive.sh: the carried site and this checkout
# on the path, and the environment vLLM 0.26 needs there (../shared/reference/vllm-gpu.md).
DEST=${PUSHKV_GPU_DIR:-/tmp/pushkv-gpu}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
export PYTHONPATH="$REPO:$DEST/site${PYTHONPATH:+:$PYTHONPATH}"
export PATH="$DEST/bin:$PATH"
export PYTHONUNBUFFERED=1
# No flashinfer on the machine: the sampler would import it at start.
export VLLM_USE_FLASHINFER_SAMPLER=0
export VLLM_HOST_IP=127.0.0.1
# With fork, EngineCore hung after "Using V2 Model Runner"; spawn comes up in ~35 s.
export VLLM_WORKER_MULTIPROC_METHOD=spawn
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 VLLM_NO_USAGE_STATS=1 NCCL_NVLS_ENABLE=0
# NIXL over UCX on this machine only; VRAM through cuda_copy/cuda_ipc. A caller's UCX_TLS wins
# (the pull diagnosis runs without tcp).
export UCX_TLS=${UCX_TLS:-tcp,sm,self,cuda_copy,cuda_ipc} UCX_NET_DEVICES=lo
# cuda_ipc's GET stays off on a GPU without active NVLink unless asked (connector/tools/pdstack.py
# GPU_IPC_GET): vLLM's pull READ was emulated over tcp/lo without it.
export UCX_CUDA_IPC_ENABLE_GET_ZCOPY=${UCX_CUDA_IPC_ENABLE_GET_ZCOPY:-on}
# `pushkv` and `vllm` as commands (the checkout is not pip-installed there).
mkdir -p "$DEST/bin"
printf '#!/bin/sh\nexec python3 -m connector.cli "$@"\n' > "$DEST/bin/pushkv"
printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > "$DEST/bin/vllm"
chmod +x "$DEST/bin/pushkv" "$DEST/bin/vllm"
