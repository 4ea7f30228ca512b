"""Builders of real vLLM KV cache configs and KV tensors for the layout tests."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheTensor,
    MLAAttentionSpec,
    compute_layout_strides,
)
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.worker.utils import allocate_kv_cache

LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn", "model.layers.2.attn")


def attn_spec(block_size: int = 16, heads: int = 2, head_size: int = 64, **kw) -> FullAttentionSpec:  # type: ignore[no-untyped-def]
    return FullAttentionSpec(
        block_size=block_size, num_kv_heads=heads, head_size=head_size, dtype=torch.bfloat16, **kw
    )


def mla_spec(block_size: int = 16, latent: int = 576) -> MLAAttentionSpec:
    return MLAAttentionSpec(
        block_size=block_size,
        num_kv_heads=1,
        head_size=latent,
        dtype=torch.bfloat16,
        max_tp_shards=1,
    )


def vllm_layout_caches(
    layout: KVCacheLayout,
    num_blocks: int = 8,
    layers: Sequence[str] = LAYERS,
    spec: FullAttentionSpec | None = None,
    kernel_block_size: int | None = None,
) -> tuple[KVCacheConfig, dict[str, torch.Tensor]]:
    """A one-group config and the per-layer views vLLM's own allocator makes for it."""
    spec = spec or attn_spec()
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    layer_stride, block_stride = strides[0], strides[1]
    size = num_blocks * len(layers) * spec.page_size_bytes
    tensor = KVCacheTensor(
        size=size, layers=list(layers), layer_stride=layer_stride, block_stride=block_stride
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)],
        kv_cache_layout=layout.name,
    )
    kernel = [kernel_block_size] if kernel_block_size else None
    caches = allocate_kv_cache(cfg, torch.device("cpu"), layout, kernel)
    return cfg, caches


def plain_config(
    num_blocks: int,
    spec,  # type: ignore[no-untyped-def]
    layers: Sequence[str] = LAYERS,
    block_stride: int | None = None,
) -> KVCacheConfig:
    """A config whose tensors the test allocates itself (legacy / MLA layouts)."""
    tensors = []
    if block_stride is not None:
        tensors = [
            KVCacheTensor(
                size=num_blocks * len(layers) * spec.page_size_bytes,
                layers=list(layers),
                layer_stride=num_blocks * block_stride,
                block_stride=block_stride,
            )
        ]
    return KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=tensors,
        kv_cache_groups=[KVCacheGroupSpec(layer_names=list(layers), kv_cache_spec=spec)],
    )
