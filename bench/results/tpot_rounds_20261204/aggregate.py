"""Per point: each config's mean TPOT and median TTFT over the rounds (median, min-max), and
push-ft against the better vLLM connector."""

import json
import statistics as st
import sys

rounds = [json.load(open(f"{d}/sweep.json")) for d in sys.argv[1:]]
vals = {}
for r in rounds:
    for p in r["points"]:
        if p["ok"]:
            vals.setdefault((p["input_len"], p["rate"], p["config"]), []).append(p["metrics"])
pts = sorted({(k[0], k[1]) for k in vals})
cfgs = ["push-ft", "vllm-pull-noprog", "vllm-push-noprog"]
for key in ("mean_tpot_ms", "median_ttft_ms"):
    print(f"\n{key}: median over {len(rounds)} rounds [min-max]")
    for L, R in pts:
        row = f"{L:5} @ {R:g}:"
        med = {}
        for c in cfgs:
            xs = [m[key] for m in vals.get((L, R, c), [])]
            if not xs:
                continue
            med[c] = st.median(xs)
            row += f"  {c} {med[c]:8.2f} [{min(xs):.2f}-{max(xs):.2f}]"
        best = min(med[c] for c in cfgs[1:] if c in med)
        row += f"  push-ft/best vLLM {med['push-ft'] / best:.2f}x"
        print(row)
