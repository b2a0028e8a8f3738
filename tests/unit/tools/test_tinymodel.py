"""Unit tests of connector/tools/tinymodel.py: determinism, caching, and loading with
transformers.

No vLLM here; transformers is only needed for the loading test (skipped without it).
"""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import os
from pathlib import Path

import pytest

from connector.tools import tinymodel, tinytokenizer
from connector.tools.tinymodel import make_tiny_model


def _hashes(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("models"))


def test_idempotent_same_path_same_files(model_dir: Path) -> None:
    before = _hashes(model_dir)
    mtimes = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}
    again = make_tiny_model(model_dir.parent)
    assert again == model_dir
    assert _hashes(again) == before
    assert {p.name: p.stat().st_mtime_ns for p in again.iterdir()} == mtimes  # not rebuilt
    assert {p.name for p in model_dir.iterdir()} == {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "special_tokens_map.json",
        "tokenizer.json",
        "tokenizer_config.json",
    }
    assert not [p for p in model_dir.parent.iterdir() if p.name.startswith(".")]  # no temp left


def test_deterministic_across_roots(model_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path)
    assert other.name == model_dir.name
    assert _hashes(other) == _hashes(model_dir)


def test_seed_changes_weights_only(model_dir: Path, tmp_path: Path) -> None:
    other = make_tiny_model(tmp_path, seed=1)
    assert other.name != model_dir.name
    a, b = _hashes(model_dir), _hashes(other)
    assert a["model.safetensors"] != b["model.safetensors"]
    assert a["tokenizer.json"] == b["tokenizer.json"]


def test_default_root_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PUSHKV_MODEL_CACHE", str(tmp_path / "cache"))
    assert make_tiny_model().parent == tmp_path / "cache"


def _build_in_child(root: str) -> str:
    return str(make_tiny_model(Path(root)))


def test_concurrent_builders_agree(tmp_path: Path) -> None:
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        paths = pool.map(_build_in_child, [str(tmp_path)] * 2)
    assert len(set(paths)) == 1
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]


def test_cli_prints_path(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert tinymodel.main(["--root", str(tmp_path), "--seed", "3"]) == 0
    printed = Path(capsys.readouterr().out.strip())
    assert printed.is_dir() and printed.parent == tmp_path and "seed3" in printed.name


def test_config_and_safetensors_layout(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (2, 256, 512)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (4, 2, 64)
    assert cfg["vocab_size"] == tinytokenizer.VOCAB_SIZE and cfg["tie_word_embeddings"] is False
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(model_dir / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    assert len(keys) == 2 * 9 + 3
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= keys


def test_bf16_rounding_is_nearest_even() -> None:
    import numpy as np

    x = np.array([1.0, -2.5, 1.00390625, 1.01171875, 3.0e-3], dtype=np.float32)
    # 1 + 2^-8 is halfway between bf16 neighbours 1 and 1 + 2^-7: ties go to even (1.0).
    got = np.frombuffer(tinymodel._to_bf16_bytes(x), dtype="<u2").astype(np.uint32) << 16
    assert got.view(np.float32)[:3].tolist() == [1.0, -2.5, 1.0]
    assert got.view(np.float32)[3] == np.float32(1.015625)  # halfway, odd neighbour below
    assert abs(got.view(np.float32)[4] - 3.0e-3) < 1e-5


def test_loads_with_transformers(model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    config = transformers.AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama" and config.vocab_size == tinytokenizer.VOCAB_SIZE
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert len(tok) == tinytokenizer.VOCAB_SIZE
    ids = tok("The quick brown fox").input_ids
    assert ids[0] == tok.bos_token_id == config.bos_token_id and ids.count(ids[0]) == 1
    assert tok.decode(ids, skip_special_tokens=True) == "The quick brown fox"
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert chat == "<s><|user|>\nhi\n<|assistant|>\n"
    chat_ids = tok(chat, add_special_tokens=False).input_ids  # as vLLM renders chat prompts
    assert chat_ids.count(tok.bos_token_id) == 1


def test_tiny_kv_has_a_real_models_kv_geometry(model_dir: Path) -> None:
    heavy = make_tiny_model(model_dir.parent, name="tiny-kv")
    assert heavy != model_dir and heavy.name.startswith("tiny-kv-")
    cfg = json.loads((heavy / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["num_key_value_heads"], cfg["head_dim"]) == (8, 8, 128)
    assert cfg["hidden_size"] == 256  # the compute stays small
    assert tinymodel.kv_bytes_per_token(cfg) == 32 * 1024  # Llama-8B's, in bf16
    assert tinymodel.kv_bytes_per_token(tinymodel.ARCH) == 1024
    # Same tokenizer as tiny: prompts of one benchmark are the same tokens for both.
    assert _hashes(heavy)["tokenizer.json"] == _hashes(model_dir)["tokenizer.json"]
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(heavy / "model.safetensors"), framework="numpy") as f:
        assert f.get_slice("model.layers.7.self_attn.k_proj.weight").get_shape() == [1024, 256]


def test_unknown_model_name_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="tiny-kv"):
        make_tiny_model(tmp_path, name="huge")


def test_tiny_mla_is_a_deepseek_v2_with_mla_and_moe_layers(model_dir: Path) -> None:
    mla = make_tiny_model(model_dir.parent, name="tiny-mla")
    cfg = json.loads((mla / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV2ForCausalLM"] and cfg["model_type"] == "deepseek_v2"
    # vLLM's CPU MLA decode kernel takes only DeepSeek's latent of 512 + 64.
    assert (cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]) == (512, 64)
    assert tinymodel.kv_bytes_per_token(cfg) == 3 * 576 * 2  # one latent per layer, bf16
    safetensors = pytest.importorskip("safetensors")
    with safetensors.safe_open(str(mla / "model.safetensors"), framework="numpy") as f:
        keys = set(f.keys())
    assert "model.layers.0.mlp.gate_proj.weight" in keys  # layer 0 dense, the others MoE
    assert {
        "model.layers.2.mlp.gate.weight",
        "model.layers.2.mlp.experts.3.down_proj.weight",
    } <= keys
    assert "model.layers.1.mlp.shared_experts.up_proj.weight" in keys
    assert "model.layers.1.self_attn.kv_a_proj_with_mqa.weight" in keys
    assert _hashes(mla)["tokenizer.json"] == _hashes(model_dir)["tokenizer.json"]


def test_tiny_swa_mixes_sliding_window_and_full_layers(model_dir: Path) -> None:
    cfg = json.loads(
        (make_tiny_model(model_dir.parent, name="tiny-swa") / "config.json").read_text()
    )
    assert cfg["architectures"] == ["LlamaForCausalLM"] and cfg["sliding_window"] == 32
    assert cfg["layer_types"] == ["sliding_attention", "full_attention"] * 2
