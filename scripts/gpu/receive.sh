#!/usr/bin/env bash
# On the GPU machine: take the part of the carried site that this call brought (.gpu/pN/,
# made by scripts/gpu/prepare.sh) into /tmp/pushkv-gpu, where the parts of earlier calls wait
# while the machine is held; once all are there, check them and unpack the site.
#   bash scripts/gpu/receive.sh && . scripts/gpu/env.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
DEST=${PUSHKV_GPU_DIR:-/tmp/pushkv-gpu}
mkdir -p "$DEST/parts"
for d in .gpu/p*/; do
  [ -d "$d" ] || continue
  cp "$d"part-* "$DEST/parts/" 2>/dev/null || true
  [ -f "$d/MANIFEST" ] && cp "$d/MANIFEST" "$DEST/MANIFEST"
done
if [ -f "$DEST/site/.complete" ]; then
  echo "receive: site ready in $DEST/site"
  exit 0
fi
[ -f "$DEST/MANIFEST" ] || { echo "receive: no MANIFEST yet (carry .gpu/p1)"; exit 0; }
. "$DEST/MANIFEST"
have=$(ls "$DEST/parts" | wc -l)
if [ "$have" -lt "$parts" ]; then
  echo "receive: $have of $parts parts here; carry the next one"
  exit 0
fi
got=$(cat "$DEST"/parts/part-* | sha256sum | cut -d' ' -f1)
[ "$got" = "$sha256" ] || { echo "receive: parts do not match the MANIFEST ($got)" >&2; exit 1; }
rm -rf "$DEST/site" && mkdir -p "$DEST/site"
t0=$(date +%s)
cat "$DEST"/parts/part-* | xz -d -T0 | tar -C "$DEST/site" -xf -
touch "$DEST/site/.complete"
echo "receive: site unpacked in $DEST/site in $(( $(date +%s) - t0 )) s"
