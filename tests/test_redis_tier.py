"""Redis as a secondary tier of vLLM's offloading (``UMBPRedisTier``), against a real
redis-server and a real Redis Cluster, with a real host buffer as the CPU primary tier:
chunks stored and loaded back byte-exact, lookups that never block the step, a
corrupted or foreign value a failed job that leaves no byte in the primary, Redis down
misses and failed stores without a hang, and vLLM's tier factory building the tier
from an OffloadingConnector config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import redis
from typed_redis import raw
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import JobResult, TransferJob
from waiting import wait_until

from umbp_redis.data.chunks import chunk_key, chunk_namespace
from umbp_redis.engine.redis_tier import UMBPRedisTier
from umbp_redis.store.errors import ConfigError
from umbp_redis.testing.embedded_cluster import EmbeddedCluster
from umbp_redis.testing.embedded_redis import free_port

CHUNKS, CHUNK_BYTES = 8, 3 * 4096
# How long a test waits for the tier's threads: only a hang takes this long, even on a
# loaded machine (never a timing goal).
WAIT_S = 30.0


def offloading_config(model: str = "tiny", layers: tuple[str, ...] = ("l0", "l1")) -> Any:
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=16, layer_names=layers, group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES // 3,
        enable_kv_cache_events=True,
        extra_config={},
        engine_id="e0",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=3),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=False,
        ),
    )


class Spec:
    """What a secondary tier reads of vLLM's OffloadingSpec."""

    def __init__(self, config: Any) -> None:
        self.config = config
        self.extra_config = config.extra_config
        self.kv_events_config = OffloadingKVEventsConfig(
            enable_kv_cache_events=config.enable_kv_cache_events,
            self_describing_kv_events=False,
        )


def primary() -> tuple[np.ndarray, memoryview]:
    rows = np.zeros((CHUNKS, CHUNK_BYTES), dtype=np.uint8)
    return rows, rows.data


def make_tier(url: str, view: memoryview, config: Any = None, **options: Any) -> UMBPRedisTier:
    """A tier on ``url`` with ``options``; lookups wait up to ``WAIT_S`` for Redis unless
    a test says otherwise (the default, 0.25 s, a loaded machine can outlast: the
    chunks would read as misses)."""
    options.setdefault("lookup_timeout_s", WAIT_S)
    return UMBPRedisTier(
        Spec(config or offloading_config()),  # type: ignore[arg-type]
        view,
        "umbp_redis",
        redis_url=url,
        enable_kv_events=True,
        **options,
    )


def keys(n: int, seed: int = 0) -> list[Any]:
    return [make_offload_key(bytes([seed, i]) * 16, 0) for i in range(n)]


def finish(tier: UMBPRedisTier, job_id: int) -> JobResult:
    """The result of job ``job_id`` once the tier reports it (bounded)."""
    tier.drain_jobs()  # each job ends within the store's timeouts

    found: list[JobResult] = []

    def reported() -> bool:
        found.extend(r for r in tier.get_finished_jobs() if r.job_id == job_id)
        return bool(found)

    wait_until(reported, WAIT_S, what=f"job {job_id}'s result")
    return found[0]


def lookup_all(tier: UMBPRedisTier, ks: list[Any], ctx: ReqContext) -> list[LookupResult]:
    """Each key's lookup answer once the async lookup answered (RETRY until then)."""
    first = [tier.lookup(k, ctx) for k in ks]
    assert set(first) == {LookupResult.RETRY}  # nothing waits on Redis in the step
    tier.on_schedule_end(ScheduleEndContext((), ()))

    got: list[LookupResult] = []

    def answered() -> bool:
        tier._lookups.drain_results()
        got[:] = [tier.lookup(k, ctx) for k in ks]
        return LookupResult.RETRY not in got

    wait_until(answered, WAIT_S, what=lambda: f"the lookups' answers (last seen: {got})")
    return got


def job(job_id: int, ks: list[Any], chunk_ids: list[int], promotion: bool) -> TransferJob:
    return TransferJob(job_id, ks, np.array(chunk_ids), promotion, ReqContext("r"))


def roundtrip(url: str) -> None:
    rows, view = primary()
    rng = np.random.default_rng(1)
    rows[:4] = rng.integers(0, 256, size=(4, CHUNK_BYTES), dtype=np.uint8)
    want = rows[:4].copy()
    tier = make_tier(url, view)
    try:
        ks = keys(4)
        tier.submit_store(job(1, ks, [0, 1, 2, 3], promotion=False))
        stored = finish(tier, 1)
        assert stored.success and stored.transfer_bytes == 4 * CHUNK_BYTES
        events = list(tier.take_events())
        assert [e.keys for e in events] == [ks] and events[0].locality == Locality.REMOTE
        ctx = ReqContext("r2")
        assert lookup_all(tier, [*ks, *keys(1, seed=9)], ctx) == [LookupResult.HIT] * 4 + [
            LookupResult.MISS
        ]
        rows[:] = 0
        tier.submit_load(job(2, ks[::-1], [4, 5, 6, 7], promotion=True))
        loaded = finish(tier, 2)
        assert loaded.success and loaded.successful_keys is None
        assert np.array_equal(rows[4:8], want[::-1])  # byte-exact, into the given rows
        tier.touch(ks, ctx)
        tier.on_request_finished(ctx)
        tier.drain_jobs()
        # A job leaves the pending set in its future's done-callback, which may run
        # just after drain_jobs saw the future done.
        wait_until(lambda: not tier.has_pending_work(), WAIT_S, what="no pending work")
    finally:
        tier.shutdown()


def test_chunks_round_trip_on_one_server(redis_url: str) -> None:
    roundtrip(redis_url)


def test_chunks_round_trip_on_a_cluster() -> None:
    with EmbeddedCluster() as cl:
        roundtrip(cl.url)
        # Chunk keys spread over the masters.
        assert sum(1 for n in cl.masters if redis.Redis(port=n.port).dbsize()) >= 2


def test_bad_values_fail_the_job_and_leave_no_byte_in_the_primary(redis_url: str) -> None:
    rows, view = primary()
    rows[0:3] = 7
    tier = make_tier(redis_url, view)
    other_model = make_tier(redis_url, view, offloading_config(model="other"))
    try:
        ks = keys(3)
        tier.submit_store(job(1, ks, [0, 1, 2], promotion=False))
        assert finish(tier, 1).success
        r = redis.Redis.from_url(redis_url)
        value = r.hgetall(chunk_key(tier.namespace, ks[1]))
        field = next(f for f, v in value.items() if len(v) > 1000)
        r.hset(chunk_key(tier.namespace, ks[1]), field, b"\x00" + raw(value[field])[1:])  # corrupt
        # Another chunk's value under this chunk's key (a value is bound to its key).
        r.copy(
            chunk_key(tier.namespace, ks[0]).decode(),
            chunk_key(tier.namespace, ks[2]).decode(),
            replace=True,
        )
        rows[3:6] = 0xEE
        tier.submit_load(job(2, ks, [3, 4, 5], promotion=True))
        res = finish(tier, 2)
        assert not res.success and list(res.successful_keys or []) == [ks[0]]
        assert (rows[3] == 7).all() and (rows[4] == 0).all() and (rows[5] == 0).all()
        # Another model's tier reads none of these chunks.
        assert other_model.namespace != tier.namespace
        assert lookup_all(other_model, ks, ReqContext("o")) == [LookupResult.MISS] * 3
        other_model.submit_load(job(3, ks[:1], [6], promotion=True))
        assert not finish(other_model, 3).success and (rows[6] == 0).all()
    finally:
        tier.shutdown()
        other_model.shutdown()


def test_redis_down_is_misses_and_failed_jobs_within_the_timeouts() -> None:
    """Nothing listening: lookups miss and jobs fail (each ends within the store's
    timeouts: ``finish`` and ``lookup_all`` would otherwise fail waiting for them)."""
    rows, view = primary()
    url = f"redis://127.0.0.1:{free_port()}/0"
    tier = make_tier(url, view, op_timeout_s=0.3, lookup_timeout_s=0.3, connect_timeout_s=0.3)
    try:
        ks = keys(2)
        assert lookup_all(tier, ks, ReqContext("r")) == [LookupResult.MISS] * 2
        tier.submit_store(job(1, ks, [0, 1], promotion=False))
        assert not finish(tier, 1).success
        tier.submit_load(job(2, ks, [2, 3], promotion=True))
        assert not finish(tier, 2).success
        assert tier.failed_stores == 2 and tier.failed_loads == 2
    finally:
        tier.shutdown()


def test_options_are_checked_and_a_password_is_refused(redis_url: str) -> None:
    _, view = primary()
    with pytest.raises(ConfigError, match="unknown options"):
        make_tier(redis_url, view, redis_ur="x")
    with pytest.raises(ConfigError, match="password_file") as ei:
        make_tier(redis_url.replace("redis://", "redis://:hunter2@"), view)
    assert "hunter2" not in str(ei.value)


def test_vllms_factory_builds_the_tier_by_type_and_by_module_path(redis_url: str) -> None:
    from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory

    from umbp_redis.plugin import register

    register()  # what vLLM's plugin loading does in every process
    _, view = primary()
    spec: Any = Spec(offloading_config())
    built: list[Callable[[], Any]] = [
        lambda: SecondaryTierFactory.create_secondary_tier(
            {"type": "umbp_redis", "redis_url": redis_url}, view, spec
        ),
        lambda: SecondaryTierFactory.create_secondary_tier(
            {
                "type": "UMBPRedisTier",
                "module_path": "umbp_redis.engine.redis_tier",
                "redis_url": redis_url,
            },
            view,
            spec,
        ),
    ]
    for make in built:
        tier = make()
        try:
            assert isinstance(tier, UMBPRedisTier)
            assert tier.namespace == chunk_namespace(spec.config, CHUNK_BYTES)
        finally:
            tier.shutdown()


def _tiering_manager(engine_id: str, url: str) -> Any:
    """vLLM's TieringOffloadingManager: a CPU primary tier in a shared-memory region (as
    the OffloadingConnector's scheduler makes it) and this tier as its secondary."""
    import mmap

    from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
    from vllm.v1.kv_offload.tiering.manager import (
        CPUPrimaryTierOffloadingManager,
        TieringOffloadingManager,
    )

    region = SharedOffloadRegion(
        engine_id=engine_id,
        num_chunks=CHUNKS,
        rank=None,
        kv_bytes_per_chunk=CHUNK_BYTES,
        cpu_page_size=mmap.PAGESIZE,
    )
    primary_tier = CPUPrimaryTierOffloadingManager(num_chunks=CHUNKS, mmap_region=region)
    tier = make_tier(url, primary_tier.get_kv_memoryview())
    return TieringOffloadingManager(primary_tier=primary_tier, secondary_tiers=[tier])


def _step_until(manager: Any, done: Callable[[], bool], what: str) -> None:
    """Run scheduler steps (``on_schedule_end``) until ``done()``, bounded; the tier's
    threads work between steps (``wait_until``'s polls)."""

    def stepped() -> bool:
        if done():
            return True
        manager.on_schedule_end(ScheduleEndContext((), ()))
        return False

    wait_until(stepped, WAIT_S, what=f"the chunks {what}")


def test_a_second_engine_promotes_the_first_ones_chunks_through_vllms_tiering(
    redis_url: str,
) -> None:
    import mmap

    assert CHUNK_BYTES % mmap.PAGESIZE == 0
    first = _tiering_manager("umbp-tier-test-a", redis_url)
    second = _tiering_manager("umbp-tier-test-b", redis_url)
    ks = keys(3, seed=5)
    rng = np.random.default_rng(3)
    data = rng.integers(0, 256, size=(3, CHUNK_BYTES), dtype=np.uint8)
    try:
        # Engine one: chunks written to its primary tier (the GPU->CPU copy), then
        # completed: the tiering manager cascades them to Redis.
        ctx = ReqContext("a")
        first.on_new_request(ctx)
        out = first.prepare_store(ks, ctx)
        assert out is not None and list(out.keys_to_store) == ks
        flat = first.primary_tier.get_kv_memoryview().cast("B")
        for row, chunk in zip(data, out.store_spec.chunk_ids, strict=True):
            flat[int(chunk) * CHUNK_BYTES : (int(chunk) + 1) * CHUNK_BYTES] = row.tobytes()
        first.complete_store(ks, ctx)
        _step_until(first, lambda: not first.has_pending_work(), "stored")
        first.on_request_finished(ctx)
        # Engine two: its primary tier misses, this tier hits, vLLM promotes the chunks.
        ctx2 = ReqContext("b")
        second.on_new_request(ctx2)

        def all_hit() -> bool:
            return all(second.lookup(k, ctx2) is LookupResult.HIT for k in ks)

        _step_until(second, all_hit, "promoted")
        spec = second.prepare_load(ks, ctx2)
        flat2 = second.primary_tier.get_kv_memoryview().cast("B")
        got = [
            bytes(flat2[int(c) * CHUNK_BYTES : (int(c) + 1) * CHUNK_BYTES])
            for c in spec.chunk_ids  # type: ignore[attr-defined]
        ]
        assert got == [row.tobytes() for row in data]
        second.complete_load(ks, ctx2)
        second.on_request_finished(ctx2)
    finally:
        first.shutdown()
        second.shutdown()
