"""The worker half against a real Redis server, with real vLLM-shaped KV tensors."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from kv_fixtures import attn_spec, fill_random, page_bytes, vllm_layout_caches
from test_data_identity import make_vllm_config
from vllm.config import ModelConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.config import RedisSettings, validate_options
from umbp_redis.data import BlockLoadBatch, BlockStoreBatch, UMBPConnectorMetadata
from umbp_redis.dataplane import RedisDataPlane
from umbp_redis.worker import UMBPWorker

NB = 16
H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model), dtype="bfloat16", max_model_len=1024)


def make_worker(model_config: ModelConfig, url: str, **extra) -> tuple[UMBPWorker, dict]:  # type: ignore[no-untyped-def, type-arg]
    cfg = make_vllm_config(model_config, extra={"redis_url": url, **extra})
    kv, caches = vllm_layout_caches(
        KVCacheLayout.LBHNC, num_blocks=NB, spec=attn_spec(block_size=128)
    )
    opts = validate_options(cfg.kv_transfer_config.kv_connector_extra_config)
    w = UMBPWorker(
        cfg, kv, opts, dataplane=RedisDataPlane(RedisSettings.from_options(opts)), ranks=(0, 0, 0)
    )
    w.register_kv_caches(caches)
    return w, caches


def step(w: UMBPWorker, meta: UMBPConnectorMetadata) -> None:
    w.bind(meta)
    w.start_load_kv()
    w.wait_for_save()
    w.clear()


def wait_loaded(w: UMBPWorker, rid: str) -> set[int]:
    deadline = time.monotonic() + 10
    errors: set[int] = set()
    while time.monotonic() < deadline:
        errors |= w.get_block_ids_with_load_errors()
        _, done = w.get_finished()
        if done and rid in done:
            return errors | w.get_block_ids_with_load_errors()
        time.sleep(0.01)
    raise AssertionError(f"{rid} never finished loading")


def test_store_then_load_into_another_engine(model_config: ModelConfig, redis_url: str) -> None:
    src, src_caches = make_worker(model_config, redis_url)
    fill_random(src_caches, seed=5)
    step(
        src,
        UMBPConnectorMetadata(stores=[BlockStoreBatch("r1", (H1, H2), (3, 4), (0, 0), event_id=7)]),
    )
    wmeta = src.build_worker_meta()
    assert wmeta is not None and wmeta.store_results[7].finished_workers == 1
    deadline = time.monotonic() + 10
    while not src.idle() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert src.staging is not None and src.staging.free_slots == src.staging.num_slots
    assert src.stats.totals["blocks_stored"] == 2

    dst, dst_caches = make_worker(model_config, redis_url)
    step(
        dst,
        UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1, H2, H3), (9, 10, 11), (0, 0, 0))]),
    )
    errors = wait_loaded(dst, "r2")
    assert errors == {11}  # H3 was never stored: that block is recomputed
    for name in src_caches:
        assert torch.equal(page_bytes(dst_caches[name], 9, NB), page_bytes(src_caches[name], 3, NB))
        assert torch.equal(
            page_bytes(dst_caches[name], 10, NB), page_bytes(src_caches[name], 4, NB)
        )
        assert not page_bytes(dst_caches[name], 11, NB).any()


def test_sync_load_reports_errors_without_finished_ids(
    model_config: ModelConfig, redis_url: str
) -> None:
    w, _ = make_worker(model_config, redis_url)
    step(w, UMBPConnectorMetadata(loads=[BlockLoadBatch("r", (H3,), (2,), (0,))], load_async=False))
    assert w.get_block_ids_with_load_errors() == {2}
    assert w.get_finished() == (None, None)


def test_full_staging_drops_stores_but_reports_the_event(
    model_config: ModelConfig, redis_url: str
) -> None:
    w, caches = make_worker(model_config, redis_url, max_staging_bytes=1)  # one slot
    fill_random(caches)
    step(
        w,
        UMBPConnectorMetadata(stores=[BlockStoreBatch("r", (H1, H2), (1, 2), (0, 0), event_id=3)]),
    )
    meta = w.build_worker_meta()
    assert meta is not None and 3 in meta.store_results  # the scheduler can unpin
    assert w.stats.totals["stores_dropped"] == 2


def test_cancelled_load_is_not_scattered(model_config: ModelConfig, redis_url: str) -> None:
    src, caches = make_worker(model_config, redis_url)
    fill_random(caches, seed=2)
    step(src, UMBPConnectorMetadata(stores=[BlockStoreBatch("r1", (H1,), (3,), (0,), event_id=1)]))
    while not src.idle():
        time.sleep(0.01)
    dst, dst_caches = make_worker(model_config, redis_url)
    dst.bind(UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1,), (6,), (0,))]))
    with dst._lock:  # the scheduler preempts r2 before its load lands
        dst._cancelled.add("r2")
    dst._run_load(dst.meta.loads[0], True)  # type: ignore[union-attr]
    assert "r2" in (dst.get_finished()[1] or set())
    assert all(not page_bytes(t, 6, NB).any() for t in dst_caches.values())
