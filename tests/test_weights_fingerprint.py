"""The weights fingerprint of the derived namespace: cheap, and it sees new weights."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from helpers import make_vllm_config, rewrite_weights
from kv_fixtures import attn_spec, vllm_layout_caches
from vllm.config import ModelConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.data import UMBPNamespace, namespace_inputs
from umbp_redis.engine.weights import local_fingerprint, weights_fingerprint


@pytest.fixture
def model_copy(tiny_model: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(tiny_model, dst)
    return dst


def test_new_weights_at_the_same_path_change_the_fingerprint(model_copy: Path) -> None:
    mc = ModelConfig(model=str(model_copy), dtype="bfloat16", max_model_len=1024)
    before = weights_fingerprint(mc)
    assert before.startswith("sampled:") and weights_fingerprint(mc) == before  # stable
    sizes = {p.name: p.stat().st_size for p in model_copy.glob("*.safetensors")}
    rewrite_weights(model_copy, seed=123)
    assert {p.name: p.stat().st_size for p in model_copy.glob("*.safetensors")} == sizes
    assert weights_fingerprint(mc) != before
    assert weights_fingerprint(mc, "off") == "off"


def test_dummy_weights_are_never_the_files_weights(model_copy: Path) -> None:
    """vLLM's ``--load-format dummy`` fills the model with random weights: its engines
    must not share KV blocks with engines that load the files at the same path."""
    from vllm.config import LoadConfig

    mc = ModelConfig(model=str(model_copy), dtype="bfloat16", max_model_len=1024)
    dummy = weights_fingerprint(mc, load_format=str(LoadConfig(load_format="dummy").load_format))
    assert dummy.startswith("dummy:")
    assert dummy != weights_fingerprint(mc) and dummy != weights_fingerprint(mc, "full")
    assert weights_fingerprint(mc, load_format="safetensors") == weights_fingerprint(mc)


def test_full_mode_sees_a_byte_the_samples_skip(tmp_path: Path) -> None:
    weights = tmp_path / "model-00001-of-00001.safetensors"
    data = bytearray(range(256)) * (4 << 12)  # 4 MiB: the 16 windows cover a quarter
    weights.write_bytes(bytes(data))
    sampled, full = local_fingerprint(tmp_path), local_fingerprint(tmp_path, full=True)
    assert sampled is not None and sampled.startswith("sampled:")
    data[len(data) // 15 + 70_000] ^= 0xFF  # between two sampled windows
    weights.write_bytes(bytes(data))
    assert local_fingerprint(tmp_path, full=True) != full
    assert local_fingerprint(tmp_path) == sampled  # the documented limit of sampling
    data[0] ^= 0xFF  # inside the first window
    weights.write_bytes(bytes(data))
    assert local_fingerprint(tmp_path) != sampled


def test_hub_models_use_the_cached_commit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from huggingface_hub import constants

    repo = tmp_path / "hub" / "models--org--tiny"
    commit = "0123456789abcdef0123456789abcdef01234567"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    (repo / "snapshots" / commit).mkdir(parents=True)
    (repo / "snapshots" / commit / "config.json").write_text("{}")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    class Cfg:
        model, revision, load_format = "org/tiny", None, "auto"

    assert weights_fingerprint(Cfg()) == f"hub:{commit}"
    Cfg.model = "org/absent"
    assert weights_fingerprint(Cfg()) == "unknown"


def test_namespace_covers_weights_and_block_hash_algorithm(model_copy: Path) -> None:
    mc = ModelConfig(model=str(model_copy), dtype="bfloat16", max_model_len=1024)
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=8, spec=attn_spec(block_size=128))
    cfg = make_vllm_config(mc)
    a = UMBPNamespace.from_vllm_config(cfg, kv, weights_fingerprint(mc)).value
    assert UMBPNamespace.from_vllm_config(cfg, kv, weights_fingerprint(mc)).value == a
    assert namespace_inputs(cfg, kv, "w")["block_hash_algo"] == "sha256"
    cfg.cache_config.prefix_caching_hash_algo = "sha256_cbor"
    assert UMBPNamespace.from_vllm_config(cfg, kv, weights_fingerprint(mc)).value != a
    cfg.cache_config.prefix_caching_hash_algo = "sha256"
    rewrite_weights(model_copy, seed=7)
    assert UMBPNamespace.from_vllm_config(cfg, kv, weights_fingerprint(mc)).value != a
