"""``umbp-redis demo``: KV blocks through Redis and back, on this CPU machine.

Needs no configuration: without ``--redis-url`` it starts a private Redis server.
It allocates KV caches exactly as vLLM 0.32 does on CPU (per-layer views into one
shared tensor), plans every block with ``KVLayoutPlanner``, stores the blocks under
keys of the documented schema, loads them into a second, empty cache (as a fresh
engine would) and checks the bytes are identical.
"""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="store KV blocks in Redis and load them back (CPU)")
    p.add_argument("--redis-url", default=None, help="server (default: a private one)")
    p.add_argument("--blocks", type=int, default=64, help="KV blocks to move (default 64)")
    p.add_argument("--layers", type=int, default=8, help="model layers (default 8)")
    p.set_defaults(handler=run_demo)


def _caches(num_blocks: int, layers: list[str]) -> tuple[Any, dict[str, torch.Tensor]]:
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    layout = KVCacheLayout.LBHNC  # what vLLM 0.32's CPU attention uses
    strides = compute_layout_strides(spec, num_blocks, len(layers), layout)
    tensor = KVCacheTensor(
        size=num_blocks * len(layers) * spec.page_size_bytes,
        layers=layers,
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    cfg = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[tensor],
        kv_cache_groups=[KVCacheGroupSpec(layer_names=layers, kv_cache_spec=spec)],
        kv_cache_layout=layout.name,
    )
    return cfg, allocate_kv_cache(cfg, torch.device("cpu"), layout)


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when every block came back byte-identical."""
    from umbp_redis.embedded_redis import EmbeddedRedis

    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"started a private Redis server at {url}")
    try:
        return _demo(url, args.blocks, args.layers)
    finally:
        if server is not None:
            server.cleanup()


def _demo(url: str, num_blocks: int, num_layers: int) -> int:
    import torch

    from umbp_redis.config import RedisSettings
    from umbp_redis.cpu_copy import CpuBlockCopier
    from umbp_redis.data import BlockIdentityCodec, KVLayoutPlanner, RankTopology
    from umbp_redis.dataplane import LoadStatus, RedisDataPlane, StoreStatus

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    cfg, src = _caches(num_blocks, layers)
    for t in src.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    cfg2, dst = _caches(num_blocks, layers)
    codec = BlockIdentityCodec("demo", RankTopology())
    hashes = [
        torch.randint(0, 256, (32,), dtype=torch.uint8).numpy().tobytes() for _ in range(num_blocks)
    ]
    dp = RedisDataPlane(RedisSettings.from_url(url))

    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(src)
    layout = planner.layout(0)
    staging = torch.zeros((num_blocks, layout.object_size), dtype=torch.uint8)
    plans = [planner.plan_for_block(codec.key(h, 0), b, bases) for b, h in enumerate(hashes)]
    copier = CpuBlockCopier(src)
    t0 = time.perf_counter()
    for i, p in enumerate(plans):
        copier.gather(p, staging[i])
    rows = staging.numpy()  # one numpy view of the staging memory, sliced per block
    items = [(p.key, rows[i]) for i, p in enumerate(plans)]
    stored = dp.store(items, layout.fingerprint)
    t_store = time.perf_counter() - t0

    planner2 = KVLayoutPlanner(cfg2)
    bases2 = planner2.register_kv_caches(dst)
    staging2 = torch.zeros_like(staging)
    dp.ping()  # connect before timing
    plans2 = [planner2.plan_for_block(codec.key(h, 0), b, bases2) for b, h in enumerate(hashes)]
    t0 = time.perf_counter()
    rows2 = staging2.numpy()
    hits = dp.lookup([p.key for p in plans2])
    loaded = dp.load(
        [(p.key, memoryview(rows2[i])) for i, p in enumerate(plans2)],
        planner2.layout(0).fingerprint,
    )
    copier2 = CpuBlockCopier(dst)
    for i, p in enumerate(plans2):
        if loaded[i] is LoadStatus.LOADED:
            copier2.scatter(p, staging2[i])
    t_load = time.perf_counter() - t0
    equal = all(torch.equal(src[n], dst[n]) for n in layers)
    total = num_blocks * layout.object_size
    table = [
        ("KV blocks (128 tokens each)", str(num_blocks)),
        ("bytes per block object", f"{layout.object_size:,}"),
        ("keys stored", str(sum(s is StoreStatus.STORED for s in stored))),
        ("lookup hits", f"{sum(hits or [])}/{num_blocks}"),
        ("blocks loaded", str(sum(s is LoadStatus.LOADED for s in loaded))),
        ("store (gather + Redis) GB/s", f"{total / t_store / 1e9:.2f}"),
        ("load (Redis + scatter) GB/s", f"{total / t_load / 1e9:.2f}"),
        ("example key", plans[0].key),
        ("caches byte-identical", "yes" if equal else "NO"),
    ]
    width = max(len(a) for a, _ in table)
    for a, b in table:
        print(f"{a:<{width}}  {b}")
    dp.delete([p.key for p in plans])
    dp.close()
    return 0 if equal else 1
