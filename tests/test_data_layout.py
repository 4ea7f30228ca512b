"""KVLayoutPlanner and the CPU copier on the tensors vLLM builds, and on other layouts."""

from __future__ import annotations

from typing import Any, cast

import layout_cases
import pytest
import torch
from kv_fixtures import LAYERS, attn_spec, mla_spec, plain_config, vllm_layout_caches
from layout_cases import fill_random, page_bytes, zeroed_clone
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.data import KVLayoutError, KVLayoutPlanner, KVRange
from umbp_redis.engine.copy.torch_copy import KVStorageRanges, PlanOutOfBounds


def _round_trip(cfg, caches, num_blocks, src_block=3, dst_block=5):  # type: ignore[no-untyped-def]
    fill_random(caches)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    layout = planner.layout(0)
    plan = planner.plan_for_block("k", src_block, bases)
    staging = torch.zeros(layout.object_size, dtype=torch.uint8)
    KVStorageRanges(caches).gather(plan, staging)
    # The object is every layer's page, in layer order, in memory order.
    expected = torch.cat(
        [page_bytes(caches[n], src_block, num_blocks) for n in cfg.kv_cache_groups[0].layer_names]
    )
    assert torch.equal(staging, expected)

    other = zeroed_clone(caches)
    planner2 = KVLayoutPlanner(cfg)
    bases2 = planner2.register_kv_caches(other)
    assert planner2.layout(0).fingerprint == layout.fingerprint
    plan2 = planner2.plan_for_block("k", dst_block, bases2)
    KVStorageRanges(other).scatter(plan2, staging)
    for name in cfg.kv_cache_groups[0].layer_names:
        assert torch.equal(
            page_bytes(other[name], dst_block, num_blocks),
            page_bytes(caches[name], src_block, num_blocks),
        )
        for b in range(num_blocks):
            if b != dst_block:
                assert not page_bytes(other[name], b, num_blocks).any(), f"block {b} was touched"
    return planner, plan


@pytest.mark.parametrize("layout", list(KVCacheLayout), ids=lambda lay: lay.name)
def test_vllm_allocated_layouts_round_trip(layout: KVCacheLayout) -> None:
    cfg, caches = vllm_layout_caches(layout)
    planner, plan = _round_trip(cfg, caches, 8)
    spec = cfg.kv_cache_groups[0].kv_cache_spec
    assert planner.layout(0).object_size == len(LAYERS) * spec.page_size_bytes
    regions = planner.layout(0).regions
    if layout.is_block_compact:
        assert all(len(r.segments) == 1 for r in regions)
    if layout in (KVCacheLayout.LHBNC, KVCacheLayout.BHLNC):
        # Each head's tokens are a separate run.
        assert all(len(r.segments) == cast(Any, spec).num_kv_heads for r in regions)
    if layout.is_block_outermost and layout.is_block_compact:
        # All layers of a block are adjacent: the plan coalesces into one range.
        assert len(plan.ranges) == 1


def test_cpu_engine_layout_of_vllm_032() -> None:
    """The packed 4-D (blocks, heads, block_size, 2*head_size) views vLLM 0.32 gives on CPU."""
    cfg, caches = vllm_layout_caches(
        KVCacheLayout.LBHNC, num_blocks=6, spec=attn_spec(block_size=128)
    )
    t = caches[LAYERS[0]]
    assert tuple(t.shape) == (6, 2, 128, 128)
    planner, plan = _round_trip(cfg, caches, 6)
    assert len(plan.ranges) == len(LAYERS)  # one contiguous page per layer


def test_kernel_block_split_pages() -> None:
    cfg, caches = vllm_layout_caches(
        KVCacheLayout.LBHNC, num_blocks=4, spec=attn_spec(block_size=32), kernel_block_size=16
    )
    assert caches[LAYERS[0]].shape[0] == 8  # two kernel blocks per block
    _round_trip(cfg, caches, 4, src_block=1, dst_block=2)


def test_legacy_5d_kv_outer_layout() -> None:
    nb, bs, h, hs = 6, 16, 2, 64
    spec = attn_spec(block_size=bs, heads=h, head_size=hs)
    cfg = plain_config(nb, spec)
    caches = {n: torch.empty(2, nb, bs, h, hs, dtype=torch.bfloat16) for n in LAYERS}
    planner, plan = _round_trip(cfg, caches, nb)
    # K and V of a block lie apart: two runs per layer.
    assert all(len(r.segments) == 2 for r in planner.layout(0).regions)


def test_packed_4d_layout() -> None:
    nb, bs, h, hs = 7, 16, 4, 64
    spec = attn_spec(block_size=bs, heads=h, head_size=hs)
    cfg = plain_config(nb, spec)
    caches = {n: torch.empty(nb, h, bs, 2 * hs, dtype=torch.bfloat16) for n in LAYERS}
    planner, plan = _round_trip(cfg, caches, nb)
    assert all(r.segments == ((0, spec.page_size_bytes),) for r in planner.layout(0).regions)


def test_mla_3d_latents() -> None:
    nb, bs = 4, 16
    spec = mla_spec(block_size=bs)
    cfg = plain_config(nb, spec)
    caches = {n: torch.empty(nb, bs, 576, dtype=torch.bfloat16) for n in LAYERS}
    planner, _ = _round_trip(cfg, caches, nb, src_block=1, dst_block=2)
    assert planner.layout(0).object_size == len(LAYERS) * bs * 576 * 2


def test_strided_views_into_one_shared_tensor() -> None:
    """Layers interleaved block by block in one buffer (block stride = all layers' pages)."""
    nb = 6
    spec = attn_spec(block_size=16, heads=2, head_size=64)
    _, caches = layout_cases.shared_strided("cpu", nb)
    cfg = plain_config(
        nb, spec, layers=layout_cases.LAYERS, block_stride=len(caches) * spec.page_size_bytes
    )
    planner, plan = _round_trip(cfg, caches, nb)
    assert len(plan.ranges) == 1  # the block's pages of all layers are adjacent


def test_plan_is_deterministic_and_addresses_follow_block_stride() -> None:
    cfg, caches = vllm_layout_caches(KVCacheLayout.LBHNC)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    p1 = planner.plan_for_block("key", 2, bases, request_id="r1")
    p2 = planner.plan_for_block("key", 2, bases, request_id="r1")
    assert p1 == p2 and p1.request_id == "r1" and p1.key == "key"
    p3 = planner.plan_for_block("key", 3, bases)
    stride = cfg.kv_cache_tensors[0].block_stride
    assert [
        r.engine_address - q.engine_address for r, q in zip(p3.ranges, p1.ranges, strict=True)
    ] == [stride] * len(p1.ranges)
    assert all(isinstance(r, KVRange) for r in p1.ranges)
    assert p1.layout_fingerprint == planner.layout(0).fingerprint


def test_fingerprint_differs_between_layouts() -> None:
    fps = set()
    for layout in (KVCacheLayout.LBHNC, KVCacheLayout.LHBNC):
        cfg, caches = vllm_layout_caches(layout)
        planner = KVLayoutPlanner(cfg)
        planner.register_kv_caches(caches)
        fps.add(planner.layout(0).fingerprint)
    assert len(fps) == 2


def test_register_rejects_missing_layer() -> None:
    cfg, caches = vllm_layout_caches(KVCacheLayout.LBHNC)
    caches.pop(LAYERS[1])
    with pytest.raises(KVLayoutError, match="has no registered tensor"):
        KVLayoutPlanner(cfg).register_kv_caches(caches)


def test_register_rejects_wrong_dtype() -> None:
    cfg, caches = vllm_layout_caches(KVCacheLayout.LBHNC)
    caches[LAYERS[0]] = caches[LAYERS[0]].float()
    with pytest.raises(KVLayoutError, match="dtype"):
        KVLayoutPlanner(cfg).register_kv_caches(caches)


def test_register_rejects_wrong_page_size() -> None:
    spec = attn_spec(heads=2)
    cfg = plain_config(4, spec)
    caches = {n: torch.empty(4, 3, 16, 128, dtype=torch.bfloat16) for n in LAYERS}
    with pytest.raises(KVLayoutError, match="spec says"):
        KVLayoutPlanner(cfg).register_kv_caches(caches)


def test_register_rejects_wrong_block_count() -> None:
    spec = attn_spec()
    cfg = plain_config(4, spec)
    caches = {n: torch.empty(7, 2, 16, 128, dtype=torch.bfloat16) for n in LAYERS}
    with pytest.raises(KVLayoutError, match="indexes the config's 4 blocks"):
        KVLayoutPlanner(cfg).register_kv_caches(caches)


def test_register_rejects_block_stride_mismatch() -> None:
    spec = attn_spec()
    cfg = plain_config(4, spec, block_stride=2 * spec.page_size_bytes)
    caches = {n: torch.empty(4, 2, 16, 128, dtype=torch.bfloat16) for n in LAYERS}
    with pytest.raises(KVLayoutError, match="block_stride"):
        KVLayoutPlanner(cfg).register_kv_caches(caches)


def test_plan_rejects_bad_block_and_copier_rejects_foreign_ranges() -> None:
    cfg, caches = vllm_layout_caches(KVCacheLayout.LBHNC)
    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(caches)
    with pytest.raises(KVLayoutError):
        planner.plan_for_block("k", 8, bases)
    with pytest.raises(KVLayoutError):
        planner.layout(3)
    bad = planner.plan_for_block("k", 1, {n: a + 10**9 for n, a in bases.items()})
    staging = torch.zeros(planner.layout(0).object_size, dtype=torch.uint8)
    with pytest.raises(PlanOutOfBounds):
        KVStorageRanges(caches).gather(bad, staging)
    with pytest.raises(ValueError, match="staging"):
        KVStorageRanges(caches).gather(planner.plan_for_block("k", 1, bases), staging[:10])
