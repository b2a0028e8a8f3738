#!/usr/bin/env bash
# Prepare what the GPU machine needs and cannot fetch (it has no network): the wheels of
# scripts/gpu/wheels.txt installed into one site folder for Python 3.12, trimmed of what a
# Hopper GPU never loads, packed with xz and split into parts that each fit one device call
# (64 MiB per call with the working tree). Run here, on the development machine:
#
#   bash scripts/gpu/prepare.sh            # -> .gpu/p1 .. .gpu/pN (one part each) + .gpu/MANIFEST
#
# then carry one part per call, back to back (scripts/gpu/README.md). .gpu/ stays out of git
# (.git/info/exclude). Idempotent: wheels already downloaded are kept.
set -euo pipefail
cd "$(dirname "$0")/../.."
GPU=.gpu
PART_MIB=${PART_MIB:-38}  # + the working tree (24 MB with bench/results) under a call's 64 MiB
mkdir -p "$GPU/whl"
grep -qs '^/.gpu/$' .git/info/exclude || echo '/.gpu/' >> .git/info/exclude

platforms=()
for p in manylinux_2_5 manylinux1 manylinux_2_17 manylinux2014 manylinux_2_24 manylinux_2_27 \
  manylinux_2_28 manylinux_2_31 manylinux_2_34; do
  platforms+=(--platform "${p}_x86_64")
done
target=(--only-binary=:all: --python-version 3.12 --implementation cp "${platforms[@]}" --platform any)
mapfile -t wheels < <(grep -v '^#' scripts/gpu/wheels.txt | grep .)

python3 -m pip download -q --disable-pip-version-check --no-deps "${target[@]}" -d "$GPU/whl" \
  "${wheels[@]}" 2>&1 | grep -v '^WARNING: Location' || true

rm -rf "$GPU/site"
python3 -m pip install -q --disable-pip-version-check --no-deps --no-compile "${target[@]}" \
  --target "$GPU/site" "$GPU"/whl/*.whl 2>&1 | grep -v '^WARNING: Location' || true

# What Hopper never loads (vllm-gpu.md): FlashAttention 2 (Hopper runs FA3), Blackwell's
# FMHA, the Rust front-end, DeepGEMM's builds for other Pythons, NIXL's expert-parallel
# kernels (91 MB, not the transfer API); and pip's console scripts.
site="$GPU/site"
rm -f "$site"/vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so
rm -rf "$site"/vllm/vllm-rs "$site"/vllm/third_party/fmha_sm100 "$site"/bin
rm -rf "$site"/nixl_ep "$site"/nixl_ep_cu13
rm -f "$site"/vllm/third_party/deep_gemm/_C.cpython-31[0134]-*.so
du -sh "$site"

rm -rf "$GPU"/p[0-9]* "$GPU/pack"
mkdir -p "$GPU/pack"
tar -C "$site" -cf - . | xz -6 -T2 > "$GPU/pack/site.tar.xz"
(cd "$GPU/pack" && split -b "${PART_MIB}M" -d -a 1 site.tar.xz part-)
n=0
for f in "$GPU"/pack/part-*; do
  n=$((n + 1))
  mkdir -p "$GPU/p$n"
  mv "$f" "$GPU/p$n/"
done
rm -f "$GPU/pack/site.tar.xz"
sha=$(cat "$GPU"/p*/part-* | sha256sum | cut -d' ' -f1)
printf 'parts=%s\nsha256=%s\n' "$n" "$sha" > "$GPU/MANIFEST"
for d in "$GPU"/p[0-9]*; do cp "$GPU/MANIFEST" "$d/"; done  # each call knows the whole
cat "$GPU/MANIFEST"
ls -la "$GPU"/p*/
