"""What each kind of KV cache group needs for a hit and stores, from real vLLM
``KVCacheConfig`` objects of every group kind (no engine, no server)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from vllm.v1.kv_cache_interface import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowSpec,
)

from umbp_redis.data import CacheGroupPlans, CacheGroupReach, UnsupportedCacheGroup
from umbp_redis.data.groups import FULL_ATTENTION, SLIDING_WINDOW, STATE

BS = 16


def attn(**kw: Any) -> dict[str, Any]:
    return {"block_size": BS, "num_kv_heads": 2, "head_size": 64, "dtype": torch.bfloat16, **kw}


def mamba(mode: str) -> MambaSpec:
    return MambaSpec(
        block_size=BS,
        shapes=((4, 64), (2, 64, 16)),
        dtypes=(torch.bfloat16, torch.float32),
        mamba_cache_mode=mode,
    )


def config(*specs: Any) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec([f"model.layers.{i}.attn"], spec) for i, spec in enumerate(specs)
        ],
    )


def test_each_group_kind_of_a_real_config_gets_its_reach() -> None:
    plans = CacheGroupPlans.from_kv_cache_config(
        config(
            FullAttentionSpec(**attn()),
            SlidingWindowSpec(**attn(), sliding_window=64),  # 63 tokens back: 4 blocks
            mamba("align"),
            MLAAttentionSpec(**attn(num_kv_heads=1, head_size=576)),
            SlidingWindowSpec(**attn(), sliding_window=BS + 1),  # 16 back: 1 block
        )
    )
    assert [(g.kind, g.reach_blocks) for g in plans.groups] == [
        (FULL_ATTENTION, 0),
        (SLIDING_WINDOW, 4),
        (STATE, 1),
        (FULL_ATTENTION, 0),
        (SLIDING_WINDOW, 1),
    ]
    assert not plans.all_full
    assert CacheGroupPlans.from_kv_cache_config(config(FullAttentionSpec(**attn()))).all_full


@pytest.mark.parametrize(
    ("spec", "why"),
    [
        (mamba("none"), "mamba_cache_mode 'align'"),
        (ChunkedLocalAttentionSpec(**attn(), attention_chunk_size=64), "chunked local"),
        (CrossAttentionSpec(**attn()), "not a decoder cache"),
    ],
)
def test_group_kinds_without_prefix_hits_are_refused_by_name(spec: Any, why: str) -> None:
    with pytest.raises(UnsupportedCacheGroup, match=why) as e:
        CacheGroupPlans.from_kv_cache_config(config(FullAttentionSpec(**attn()), spec))
    assert "group 1" in str(e.value)


def test_groups_of_different_block_sizes_are_refused() -> None:
    with pytest.raises(UnsupportedCacheGroup, match="block sizes"):
        CacheGroupPlans.from_kv_cache_config(
            config(FullAttentionSpec(**attn()), FullAttentionSpec(**attn(block_size=32)))
        )


def test_needed_blocks_per_kind() -> None:
    full = CacheGroupReach(0, FULL_ATTENTION, BS)
    window = CacheGroupReach(1, SLIDING_WINDOW, BS, 3)
    state = CacheGroupReach(2, STATE, BS, 1)
    assert list(full.needed(6)) == [0, 1, 2, 3, 4, 5]
    assert list(window.needed(6)) == [3, 4, 5]
    assert list(state.needed(6)) == [5]
    # Blocks the engine holds (below start) are not asked for.
    assert list(full.needed(6, start=4)) == [4, 5]
    assert list(window.needed(6, start=4)) == [4, 5]
    assert list(window.needed(2)) == [0, 1]
    # Stores: everything for full attention; else the blocks before hit points.
    assert full.stored(range(2, 8), [5]) == [2, 3, 4, 5, 6, 7]
    assert window.stored(range(0, 10), [5, 9]) == [2, 3, 4, 6, 7, 8]
    assert state.stored(range(0, 10), [5, 9]) == [4, 8]


def test_the_hit_is_the_longest_boundary_every_group_can_serve() -> None:
    plans = CacheGroupPlans(
        (CacheGroupReach(0, FULL_ATTENTION, BS), CacheGroupReach(1, SLIDING_WINDOW, BS, 2))
    )
    full_present = set(range(10))
    window_present = {0, 1, 5, 6}

    def present(block: int, pos: int) -> bool:
        return block in (full_present if pos == 0 else window_present)

    # Full attention has blocks 0..9; the window is complete only before boundaries 2
    # and 7: the hit is 7, not 10.
    assert plans.full_prefix_end(0, 10, present) == 10
    assert plans.longest_hit(0, 10, present) == 7
    # A hole in full attention caps the hit below it.
    full_present.discard(6)
    assert plans.full_prefix_end(0, 10, present) == 6
    assert plans.longest_hit(0, 10, present) == 2
    # With the engine holding blocks 0..2 locally, only blocks from 3 on count.
    assert plans.longest_hit(3, 10, present) == 3
    window_present.add(4)
    full_present.add(6)
    assert plans.longest_hit(3, 10, present) == 7
    assert plans.longest_hit(0, 0, present) == 0
