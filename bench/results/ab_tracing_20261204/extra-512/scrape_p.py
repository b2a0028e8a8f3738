"""Poll P's vLLM metrics of each stack of a running interleaved sweep; print mean prefill."""
import re, sys, time, ast
from pathlib import Path
import httpx
from connector.tools.pdstack import metric_sum

log = Path(sys.argv[1])
ports, last = {}, {}
deadline = time.time() + float(sys.argv[2])
names = ("vllm:request_prefill_time_seconds", "vllm:request_queue_time_seconds",
         "vllm:time_to_first_token_seconds", "vllm:request_inference_time_seconds")
while time.time() < deadline:
    if log.exists():
        for line in log.read_text().splitlines():
            m = re.search(r"\[(push-ft[\w-]*)\] starting; ports (\{.*?\})", line)
            if m:
                try:
                    ports[m[1]] = ast.literal_eval(m[2])["prefill"]
                except Exception:
                    pass
    for cfg, port in ports.items():
        try:
            text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).text
        except Exception:
            continue
        last[cfg] = {n: (metric_sum(text, n + "_sum"), metric_sum(text, n + "_count")) for n in names}
    time.sleep(2)
for cfg, vals in last.items():
    print(cfg, {n.split(':')[1]: (round(s / c * 1e3, 2) if c else None, c) for n, (s, c) in vals.items()})
