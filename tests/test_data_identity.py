"""Ranks, namespaces, keys and replicated groups, against real vLLM config objects."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import torch
from helpers import make_vllm_config
from kv_fixtures import LAYERS, attn_spec, mla_spec, plain_config, vllm_layout_caches
from vllm.config import KVTransferConfig, ModelConfig
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.data import (
    KEY_PREFIX,
    BlockIdentityCodec,
    RankTopology,
    UMBPNamespace,
    namespace_inputs,
    namespace_pattern,
    parse_key,
    tp_replicated_group_ids,
    value_pattern,
)

HASH = bytes(range(32))


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model), dtype="bfloat16", max_model_len=1024)


# --- RankTopology -------------------------------------------------------------------


def test_topology_validates() -> None:
    with pytest.raises(ValueError, match="tp_size"):
        RankTopology(tp_size=0)
    with pytest.raises(ValueError, match="tp_rank"):
        RankTopology(tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="pp_rank"):
        RankTopology(pp_rank=-1)
    with pytest.raises(ValueError, match="dcp_rank"):
        RankTopology(tp_rank=1, tp_size=2, dcp_size=2, dcp_rank=0)
    with pytest.raises(ValueError, match="divisible"):
        RankTopology(tp_size=3, dcp_size=2)


def test_topology_from_vllm_config_and_rank_namespaces(model_config: ModelConfig) -> None:
    cfg = make_vllm_config(model_config, tp=2)
    topo = RankTopology.from_vllm_config(cfg, tp_rank=1)
    assert (topo.tp_rank, topo.tp_size, topo.pp_size, topo.dcp_size) == (1, 2, 1, 1)
    ranks = topo.rank_namespaces()
    assert topo.num_rank_namespaces == 2 == len(ranks)
    assert [r.rank_label() for r in ranks] == ["tp0:pcp0:dcp0:pp0", "tp1:pcp0:dcp0:pp0"]


def test_dcp_rank_is_derived_like_vllm_groups() -> None:
    t = RankTopology(tp_size=4, dcp_size=2)
    assert [r.dcp_rank for r in t.rank_namespaces()] == [0, 1, 0, 1]
    t = RankTopology(tp_size=2, pcp_size=2, dcp_size=2)
    assert [(r.tp_rank, r.pcp_rank, r.dcp_rank) for r in t.rank_namespaces()] == [
        (0, 0, 0),
        (1, 0, 0),
        (0, 1, 1),
        (1, 1, 1),
    ]
    t = RankTopology(tp_size=2, pcp_size=2, dcp_size=4, pp_size=2)
    assert t.num_rank_namespaces == 8
    assert sorted({r.dcp_rank for r in t.rank_namespaces()}) == [0, 1, 2, 3]


# --- Namespace ----------------------------------------------------------------------


def test_configured_namespace(model_config: ModelConfig) -> None:
    assert UMBPNamespace.configured(make_vllm_config(model_config)) is None
    ns = UMBPNamespace.configured(make_vllm_config(model_config, extra={"key_namespace": "prod-a"}))
    assert ns is not None and ns.value == "prod-a" and not ns.derived
    with pytest.raises(ValueError, match="key_namespace"):
        UMBPNamespace.configured(make_vllm_config(model_config, extra={"key_namespace": "a:b"}))


def test_derived_namespace_is_stable(model_config: ModelConfig) -> None:
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    kv2, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    a = UMBPNamespace.from_vllm_config(make_vllm_config(model_config), kv)
    b = UMBPNamespace.from_vllm_config(make_vllm_config(model_config), kv2)
    assert a == b and a.derived and len(a.value) == 16
    assert UMBPNamespace.resolve(make_vllm_config(model_config), kv) == a


def test_derived_namespace_is_the_same_in_another_process(model_config: ModelConfig) -> None:
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    here = UMBPNamespace.from_vllm_config(make_vllm_config(model_config), kv).value
    code = f"""
import sys; sys.path.insert(0, {str(Path(__file__).parent)!r})
from kv_fixtures import vllm_layout_caches
from vllm.config import ModelConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from umbp_redis.data import UMBPNamespace
from helpers import make_vllm_config
mc = ModelConfig(model={model_config.model!r}, dtype="bfloat16", max_model_len=1024)
kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
print("NS=" + UMBPNamespace.from_vllm_config(make_vllm_config(mc), kv).value)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("NS=")]
    assert line, out.stderr[-3000:]
    assert line[0] == "NS=" + here


def test_each_input_changes_the_namespace(model_config: ModelConfig) -> None:
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    base_cfg = make_vllm_config(model_config)
    base = UMBPNamespace.from_vllm_config(base_cfg, kv).value
    variants = {}
    variants["hf_overrides"] = UMBPNamespace.from_vllm_config(
        make_vllm_config(model_config, hf_overrides={"rope_theta": 5000.0}), kv
    )
    variants["dtype"] = UMBPNamespace.from_vllm_config(
        make_vllm_config(model_config, dtype="float16"), kv
    )
    variants["revision"] = UMBPNamespace.from_vllm_config(
        make_vllm_config(model_config, revision="v2"), kv
    )
    variants["tp"] = UMBPNamespace.from_vllm_config(make_vllm_config(model_config, tp=2), kv)
    kv_lhbnc, _ = vllm_layout_caches(KVCacheLayout.LHBNC)
    variants["layout"] = UMBPNamespace.from_vllm_config(base_cfg, kv_lhbnc)
    for field_name, spec in {
        "block_size": attn_spec(block_size=32),
        "heads": attn_spec(heads=4),
        "head_size": attn_spec(head_size=128),
        "kind": mla_spec(),
        "spec_dtype": dataclasses.replace(attn_spec(), dtype=torch.float16),
    }.items():
        variants[field_name] = UMBPNamespace.from_vllm_config(base_cfg, plain_config(8, spec))
    cd = make_vllm_config(model_config)
    cd.cache_config.cache_dtype = "fp8"
    variants["cache_dtype"] = UMBPNamespace.from_vllm_config(cd, kv)
    foreign = make_vllm_config(model_config)
    foreign.kv_transfer_config = KVTransferConfig(
        kv_connector="MultiConnector",
        kv_role="kv_both",
        kv_connector_extra_config={
            "connectors": [
                {"kv_connector": "UMBPRedisConnector", "kv_role": "kv_both"},
                {"kv_connector": "NixlConnector", "kv_role": "kv_both"},
            ]
        },
    )
    assert namespace_inputs(foreign, kv)["foreign_kv"] is True
    variants["foreign_kv"] = UMBPNamespace.from_vllm_config(foreign, kv)
    values = {k: v.value for k, v in variants.items()}
    assert base not in values.values(), values
    assert len(set(values.values())) == len(values), values


def test_namespace_inputs_are_json(model_config: ModelConfig) -> None:
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    blob = json.dumps(namespace_inputs(make_vllm_config(model_config), kv))
    assert "FullAttentionSpec" in blob and "LBHNC" in blob


def test_another_part_split_rule_is_another_namespace(
    model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Engines that split objects into parts differently (another release) never share
    keys: each would find the other's values invalid and remove them."""
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC)
    cfg = make_vllm_config(model_config)
    before = UMBPNamespace.from_vllm_config(cfg, kv).value
    monkeypatch.setattr(
        "umbp_redis.data.namespace.SPLIT_RULE", {"min_part_bytes": 1 << 20, "max_parts": 16}
    )
    assert UMBPNamespace.from_vllm_config(cfg, kv).value != before


# --- Keys ---------------------------------------------------------------------------


def test_key_schema_is_exact() -> None:
    codec = BlockIdentityCodec("ns1", RankTopology(tp_rank=1, tp_size=2, pp_rank=0, pp_size=1))
    key = codec.key(HASH, 0)
    # Pins the schema: the one place tests spell a key out by hand (elsewhere the codec
    # builds them), so a change to it shows here.
    assert key == f"umbp:vllm:v2:ns1:tp1:pcp0:dcp0:pp0:g0:{HASH.hex()}"
    decoded = parse_key(key)
    assert decoded.namespace == "ns1" and decoded.tp_rank == 1 and decoded.block_hash == HASH
    assert decoded.group_id == 0
    assert codec.rank_keys(HASH, 0) == (codec.key(HASH, 0, rank=RankTopology(tp_size=2)), key)
    assert codec.stores(0)


def test_keys_never_hold_block_ids_or_request_ids() -> None:
    codec = BlockIdentityCodec("ns1")
    # The key is a function of (hash, group, rank) only: nothing else can enter it.
    assert codec.key(HASH, 3) == codec.key(bytes(HASH), 3)
    assert codec.key(HASH, 3) != codec.key(HASH, 2)
    with pytest.raises(TypeError):
        codec.key("abc", 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        parse_key(codec.key_prefixes(0)[0] + "xyz")  # not hex
    with pytest.raises(ValueError):
        parse_key(codec.key(HASH, 0) + "a")  # an odd number of hex digits
    with pytest.raises(ValueError):
        parse_key(codec.marker_key(HASH, 0))  # a marker is not a value key


def test_markers_counters_and_scan_patterns() -> None:
    """The other keys of a namespace, and the SCAN patterns that find them. As in
    ``test_key_schema_is_exact``, the expected strings pin the schema on purpose."""
    codec = BlockIdentityCodec("ns1", RankTopology(tp_rank=1, tp_size=2))
    assert KEY_PREFIX == "umbp:vllm:v2"
    assert codec.marker_key(HASH, 2) == f"umbp:vllm:v2:ns1:stored:g2:{HASH.hex()}".encode()
    assert codec.marker_prefix(2) == "umbp:vllm:v2:ns1:stored:g2:"
    assert codec.request_count_prefix == "umbp:vllm:v2:ns1:asked:"
    assert namespace_pattern("ns1") == "umbp:vllm:v2:ns1:*"
    assert namespace_pattern() == "umbp:vllm:v2:*:*"
    assert value_pattern("ns1") == "umbp:vllm:v2:ns1:tp*"
    assert value_pattern("ns1", tp_rank=1) == "umbp:vllm:v2:ns1:tp1:*"
    assert value_pattern() == "umbp:vllm:v2:*:tp*"
    # What the patterns match (fnmatch reads ``*`` as Redis's MATCH does, for these).
    value, marker = codec.key(HASH, 2), codec.marker_key(HASH, 2).decode()
    counter = codec.request_count_prefix + HASH.hex()
    other = BlockIdentityCodec("ns2").key(HASH, 2)
    replicated = BlockIdentityCodec("ns1", replicated_groups=frozenset({2})).key(HASH, 2)
    tp_named = BlockIdentityCodec("tp1").marker_key(HASH, 2).decode()  # a namespace "tp1"
    for pattern, matched in [
        (namespace_pattern("ns1"), {value, marker, counter, replicated}),
        (value_pattern("ns1"), {value, replicated}),
        (value_pattern("ns1", tp_rank=1), {value}),
        (value_pattern(), {value, other, replicated}),
    ]:
        keys = (value, marker, counter, other, replicated, tp_named)
        assert {k for k in keys if fnmatchcase(k, pattern)} == matched, pattern


def test_replicated_group_keys() -> None:
    topo = RankTopology(tp_rank=1, tp_size=4)
    codec = BlockIdentityCodec("ns", topo, frozenset({1}))
    assert ":tp*:" in codec.key(HASH, 1)
    assert codec.rank_keys(HASH, 1) == (codec.key(HASH, 1),)
    assert len(codec.rank_keys(HASH, 0)) == 4
    assert not codec.stores(1) and codec.stores(0)
    rank0 = BlockIdentityCodec(
        "ns", topo.with_ranks(tp_rank=0, pp_rank=0, pcp_rank=0), frozenset({1})
    )
    assert rank0.stores(1) and rank0.key(HASH, 1) == codec.key(HASH, 1)
    assert parse_key(codec.key(HASH, 1)).tp_rank is None


def test_tp_replicated_group_ids() -> None:
    cfg = KVCacheConfig(
        num_blocks=4,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(layer_names=[LAYERS[0]], kv_cache_spec=attn_spec()),
            KVCacheGroupSpec(layer_names=[LAYERS[1], LAYERS[2]], kv_cache_spec=mla_spec()),
        ],
    )
    assert tp_replicated_group_ids(cfg, RankTopology(tp_size=2)) == frozenset({1})
    assert tp_replicated_group_ids(cfg, RankTopology(tp_size=2, dcp_size=2)) == frozenset()
    assert tp_replicated_group_ids(cfg, RankTopology(pcp_size=2)) == frozenset()
