"""``python -m bench.gpu_model_cost`` on CPU at small sizes: the KV of every GPU model
(``bench.gpu_model.GPU_MODELS``) pushed between a P and a D process over real NIXL, each row
moving the model's KV bytes per token, every transfer's blocks equal on both sides."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.gpu_model import GPU_MODELS
from bench.gpu_model_cost import PATTERNS, geometry, main
from connector.tools.tinymodel import kv_bytes_per_token

pytestmark = [pytest.mark.nixl]

TOKENS = (128,)  # whole blocks of 16 and of MLA's 64


def test_every_gpu_models_kv_moves_its_bytes_per_token(tmp_path: Path) -> None:
    out = tmp_path / "cost.json"
    argv = ["--device", "cpu", "--tokens", ",".join(map(str, TOKENS)), "--paths", "auto"]
    rc = main([*argv, "--reps", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r for r in rows if "error" in r] == []
    assert rc == 0
    cases = {(r["model"], r["tokens"], r["pattern"]) for r in rows}
    assert cases == {(m, n, p) for m in GPU_MODELS for n in TOKENS for p in PATTERNS}
    for r in rows:
        g = geometry(r["model"])
        assert r["bytes_per_token"] == kv_bytes_per_token(GPU_MODELS[r["model"]])
        assert r["mib"] * 2**20 == r["tokens"] * r["bytes_per_token"]
        assert r["checksums_ok"] and r["path"] == "direct"  # host memory: no IPC
        assert r["rows"] == r["tokens"] // g.block_size * g.layers
        if r["pattern"] == "contiguous":  # a page per (layer, block): one run per layer
            assert r["descriptors"] == g.layers
        else:  # random ids: merged only where both sides happen to be adjacent
            assert g.layers <= r["descriptors"] <= r["rows"]
    table = out.with_suffix(".md").read_text().splitlines()
    assert len(table) == 2 + len(rows) and all(line.endswith("| ok |") for line in table[2:])
