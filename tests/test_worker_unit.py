"""The worker half against a real Redis server, with real vLLM-shaped KV tensors."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fake_servers import FrozenServer
from helpers import ktc, make_vllm_config
from kv_fixtures import LAYERS, attn_spec, vllm_layout_caches
from layout_cases import fill_random, page_bytes
from typed_redis import raw
from vllm.config import ModelConfig
from vllm.v1.kv_cache_layout import KVCacheLayout
from waiting import wait_until

from umbp_redis.data import (
    BlockLoadBatch,
    BlockStoreBatch,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
)
from umbp_redis.engine.options import parse_connector_options
from umbp_redis.engine.worker import UMBPWorker
from umbp_redis.store.cluster import ClusterDataPlane
from umbp_redis.store.deployment import open_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.testing.embedded_cluster import EmbeddedCluster
from umbp_redis.testing.embedded_redis import EmbeddedRedis

NB = 16
H1, H2, H3, H4 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32, b"\x04" * 32
# How long a test waits for transfers to end: only a hang takes this long, even on a
# loaded machine (never a timing goal).
TRANSFER_S = 30.0
# sync_load_timeout_s of the tests that freeze the server: long enough for a sync load
# on a loaded machine, short next to their op_timeout_s (an hour).
SYNC_S = 2.0


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model), dtype="bfloat16", max_model_len=1024)


def make_worker(  # type: ignore[no-untyped-def]
    model_config: ModelConfig,
    url: str,
    heads: int = 2,
    max_inflight_bytes: int | None = None,
    **extra,
) -> tuple[UMBPWorker, dict]:  # type: ignore[type-arg]
    """A worker on ``url`` with these connector options (``max_inflight_bytes``, not
    an option, set on its Redis settings). Its sync loads may take ``TRANSFER_S``
    unless a test says otherwise (the default, 0.5 s, a loaded machine can outlast:
    their blocks would be recomputed)."""
    extra = {"sync_load_timeout_s": TRANSFER_S, **extra}
    cfg = make_vllm_config(model_config, extra={"redis_url": url, **extra})
    kv, caches = vllm_layout_caches(
        KVCacheLayout.LBHNC, num_blocks=NB, spec=attn_spec(block_size=128, heads=heads)
    )
    settings, opts = parse_connector_options(ktc(cfg).kv_connector_extra_config)
    if max_inflight_bytes is not None:
        settings = dataclasses.replace(settings, max_inflight_bytes=max_inflight_bytes)
    w = UMBPWorker(cfg, kv, settings, opts, plane=open_plane(settings), ranks=(0, 0, 0))
    w.register_kv_caches(caches)
    return w, caches


def object_size(model_config: ModelConfig, url: str) -> int:
    """The bytes of one stored object of ``make_worker``'s workers."""
    probe, _ = make_worker(model_config, url)
    assert probe.staging is not None
    return probe.staging.slot_bytes


def step(w: UMBPWorker, meta: UMBPConnectorMetadata) -> None:
    w.bind(meta)
    w.start_load_kv()
    w.wait_for_save()
    w.clear()


def wait_idle(w: UMBPWorker) -> None:
    """Return once ``w`` has no transfer in flight."""
    wait_until(w.idle, TRANSFER_S, what="the worker's transfers to end")


def stored_source(
    model_config: ModelConfig, url: str, block_hash: bytes, block_id: int, seed: int
) -> tuple[UMBPWorker, dict]:  # type: ignore[type-arg]
    """A worker whose random KV block ``block_id`` has been stored under ``block_hash``."""
    src, caches = make_worker(model_config, url)
    fill_random(caches, seed=seed)
    step(
        src,
        UMBPConnectorMetadata(
            stores=[BlockStoreBatch("r1", (block_hash,), (block_id,), (0,), event_id=1)]
        ),
    )
    wait_idle(src)
    return src, caches


def wait_loaded(w: UMBPWorker, rid: str) -> set[int]:
    """Wait until ``rid``'s async load is reported finished; the blocks that failed."""
    errors: set[int] = set()

    def finished() -> bool:
        errors.update(w.get_block_ids_with_load_errors())
        return rid in w.take_finished_loads()[0]

    wait_until(finished, TRANSFER_S, what=f"{rid}'s load to finish")
    return errors | w.get_block_ids_with_load_errors()


@pytest.fixture(scope="module")
def cluster_url() -> Iterator[str]:
    with EmbeddedCluster() as c:
        yield c.url


@pytest.mark.parametrize("deployment", ["standalone", "cluster"])
def test_store_then_load_into_another_engine(
    model_config: ModelConfig, deployment: str, request: pytest.FixtureRequest
) -> None:
    redis_url = request.getfixturevalue(
        "redis_url" if deployment == "standalone" else "cluster_url"
    )
    src, src_caches = make_worker(model_config, redis_url)
    fill_random(src_caches, seed=5)
    step(
        src,
        UMBPConnectorMetadata(stores=[BlockStoreBatch("r1", (H1, H2), (3, 4), (0, 0), event_id=7)]),
    )
    wmeta = src.build_worker_meta()
    assert wmeta is not None and wmeta.store_results[7].finished_workers == 1
    wait_idle(src)
    assert src.staging is not None and src.staging.free_slots == src.staging.num_slots
    assert src.stats.take()["blocks_stored"] == 2

    dst, dst_caches = make_worker(model_config, redis_url)
    step(
        dst,
        UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1, H2, H3), (9, 10, 11), (0, 0, 0))]),
    )
    errors = wait_loaded(dst, "r2")
    assert errors == {11}  # H3 was never stored: that block is recomputed
    # An async load's blocks are cached by vLLM only once loaded: nothing to uncache.
    dmeta = dst.build_worker_meta()
    assert dmeta is None or dmeta.sync_failed_requests == ()
    for name in src_caches:
        assert torch.equal(page_bytes(dst_caches[name], 9, NB), page_bytes(src_caches[name], 3, NB))
        assert torch.equal(
            page_bytes(dst_caches[name], 10, NB), page_bytes(src_caches[name], 4, NB)
        )
        assert not page_bytes(dst_caches[name], 11, NB).any()
    stats = dst.take_stats()
    assert stats["blocks_loaded"] == 2 and stats["load_failures"] == 1
    assert isinstance(dst.plane, ClusterDataPlane) == (deployment == "cluster")
    assert stats["cluster_node_failures"] == 0


def test_sync_load_reports_errors_without_finished_ids(
    model_config: ModelConfig, redis_url: str
) -> None:
    w, _ = make_worker(model_config, redis_url)
    step(w, UMBPConnectorMetadata(loads=[BlockLoadBatch("r", (H3,), (2,), (0,), load_async=False)]))
    assert w.get_block_ids_with_load_errors() == {2}
    assert w.take_finished_loads() == (set(), set())
    # vLLM cached the sync load's blocks before it ran: the scheduler must hear of it.
    wmeta = w.build_worker_meta()
    assert wmeta is not None and wmeta.sync_failed_requests == ("r",)


def test_a_failed_sync_load_drops_the_stores_of_its_step(
    model_config: ModelConfig, redis_url: str
) -> None:
    """The forward pass of a step whose sync load failed read blocks that did not load;
    the blocks that step computed are not stored (reported failed), a step whose sync
    load worked stores them."""
    import redis

    stored_source(model_config, redis_url, H1, 3, seed=11)
    r = redis.Redis.from_url(redis_url)
    for missing, store_hash, eid in ((H3, H4, 21), (H1, H2, 22)):
        w, caches = make_worker(model_config, redis_url)
        fill_random(caches, seed=12)
        key = w.codec.key(store_hash, 0)
        r.delete(key)
        sync = BlockLoadBatch("r", (missing,), (2,), (0,), load_async=False)
        store = BlockStoreBatch("r", (store_hash,), (5,), (0,), event_id=eid)
        step(w, UMBPConnectorMetadata(loads=[sync], stores=[store]))
        wait_idle(w)
        meta = w.build_worker_meta()
        assert meta is not None and meta.store_results[eid].finished_workers == 1
        if missing == H3:  # the load failed: nothing stored, the event reports the key failed
            assert w.get_block_ids_with_load_errors() == {2}
            assert meta.store_results[eid].failed_keys == {key}
            assert not r.exists(key) and w.stats.take()["stores_dropped"] == 1
        else:
            assert w.get_block_ids_with_load_errors() == set()
            assert not meta.store_results[eid].failed_keys and r.exists(key)


def test_full_staging_drops_stores_but_reports_the_event(
    model_config: ModelConfig, redis_url: str
) -> None:
    one_slot = object_size(model_config, redis_url)
    w, caches = make_worker(model_config, redis_url, max_staging_bytes=one_slot)
    assert w.staging is not None and w.staging.num_slots == 1
    fill_random(caches)
    step(
        w,
        UMBPConnectorMetadata(stores=[BlockStoreBatch("r", (H1, H2), (1, 2), (0, 0), event_id=3)]),
    )
    meta = w.build_worker_meta()
    assert meta is not None and 3 in meta.store_results  # the scheduler can unpin
    assert w.stats.take()["stores_dropped"] == 2


def test_staging_budget_below_one_object_is_a_config_error(
    model_config: ModelConfig, redis_url: str
) -> None:
    size = object_size(model_config, redis_url)
    with pytest.raises(ConfigError, match=rf"max_staging_bytes.*{size - 1}.*at least {size}"):
        make_worker(model_config, redis_url, max_staging_bytes=size - 1)


def test_cancelled_load_is_not_scattered(model_config: ModelConfig, redis_url: str) -> None:
    src, caches = stored_source(model_config, redis_url, H1, 3, seed=2)
    dst, dst_caches = make_worker(model_config, redis_url)
    dst.loader.direct_loads = False  # the staging path (device KV caches); see the next test
    dst.bind(UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1,), (6,), (0,))]))
    with dst._lock:  # the scheduler preempts r2 before its load lands
        dst._cancelled.add("r2")
    dst._run_load(dst.meta.loads[0], True, None)  # type: ignore[union-attr]
    assert "r2" in dst.take_finished_loads()[0]
    assert all(not page_bytes(t, 6, NB).any() for t in dst_caches.values())


class GatedCopier:
    """The worker's own copier, but a copy happens only once the test has opened the
    gate: like a GPU copy still running on its stream. The handle runs the copy the
    first time ``wait`` or ``done`` finds the gate open, and ``done`` never blocks.

    A worker that sent staging bytes before waiting for the gather would store zeros,
    one that unpinned source blocks before the gather read them would store what the
    engine wrote next, and one that reported a load before waiting for the scatter
    would be caught with the destination still empty.
    """

    name = "gated"

    def __init__(self, inner, fail: str = "") -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.gate = threading.Event()
        self.fail = fail
        self.points: list[tuple[object, str]] = []
        self.scatter_after: list[object] = []
        self.waiting = threading.Event()  # a thread waits for a gated copy

    def engine_point(self) -> object:
        point = object()
        self.points.append((point, threading.current_thread().name))
        return point

    def _handle(self, copy):  # type: ignore[no-untyped-def]
        gate, fail, waiting = self.gate, self.fail, self.waiting
        lock, copied = threading.Lock(), []

        class Handle:
            def _finish(self) -> None:
                if fail == "wait":
                    raise RuntimeError("device copy failed")
                with lock:
                    if not copied:
                        copy()
                        copied.append(True)

            def wait(self) -> None:
                waiting.set()
                assert gate.wait(10), "the test never opened the gate"
                self._finish()

            def done(self) -> bool:
                if not gate.is_set():
                    return False
                self._finish()
                return True

        return Handle()

    def gather(self, plan):  # type: ignore[no-untyped-def]
        if self.fail == "launch":
            raise RuntimeError("kernel launch failed")
        return self._handle(lambda: self.inner.gather(plan))

    def scatter(self, plan, after=None):  # type: ignore[no-untyped-def]
        self.scatter_after.append(after)
        return self._handle(lambda: self.inner.scatter(plan, after))


def _gate(w: UMBPWorker, fail: str = "") -> GatedCopier:
    gated = GatedCopier(w.copier, fail)
    w.copier = gated  # type: ignore[assignment]
    return gated


def test_store_sends_only_after_its_gather_completes(
    model_config: ModelConfig, redis_url: str
) -> None:
    import redis

    src, src_caches = make_worker(model_config, redis_url)
    fill_random(src_caches, seed=8)
    want = {name: page_bytes(t, 5, NB).clone() for name, t in src_caches.items()}
    gated = _gate(src)
    step(src, UMBPConnectorMetadata(stores=[BlockStoreBatch("r1", (H1,), (5,), (0,), event_id=4)]))
    assert gated.waiting.wait(10)  # the store thread waits for the gather: its writes follow
    r = redis.Redis.from_url(redis_url)
    assert r.dbsize() == 0 and not src.idle()  # nothing is sent before the copy ...
    # ... and the source blocks stay pinned: no report while the gather runs, steps on.
    assert src.build_worker_meta() is None
    step(src, UMBPConnectorMetadata())
    assert src.build_worker_meta() is None
    gated.gate.set()
    meta = src.build_worker_meta()  # the first step that finds the gather done reports
    assert meta is not None and meta.store_results[4].failed_keys == frozenset()
    fill_random(src_caches, seed=80)  # the unpinned block is reused by the engine
    wait_idle(src)
    assert r.dbsize() == 1

    dst, dst_caches = make_worker(model_config, redis_url)
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1,), (2,), (0,))]))
    assert wait_loaded(dst, "r2") == set()
    for name in src_caches:
        assert torch.equal(page_bytes(dst_caches[name], 2, NB), want[name])


def test_load_finishes_only_after_its_scatter_completes(
    model_config: ModelConfig, redis_url: str
) -> None:
    src, src_caches = stored_source(model_config, redis_url, H2, 7, seed=9)

    dst, dst_caches = make_worker(model_config, redis_url)
    gated = _gate(dst)
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H2,), (3,), (0,))]))
    # The engine point is taken on the engine's thread when the load starts, and the
    # scatter is ordered after it.
    assert [t for _, t in gated.points] == [threading.current_thread().name]
    assert gated.waiting.wait(10)  # the load thread waits for the scatter: its report follows
    assert dst.take_finished_loads() == (set(), set())
    assert gated.scatter_after == [gated.points[0][0]]
    gated.gate.set()
    assert wait_loaded(dst, "r2") == set()
    for name in src_caches:
        assert torch.equal(page_bytes(dst_caches[name], 3, NB), page_bytes(src_caches[name], 7, NB))


@pytest.mark.parametrize("fail", ["launch", "wait"])
def test_failed_gather_drops_the_store_and_frees_staging(
    model_config: ModelConfig, redis_url: str, fail: str
) -> None:
    import redis

    w, caches = make_worker(model_config, redis_url)
    fill_random(caches)
    gated = _gate(w, fail)
    gated.gate.set()
    step(
        w,
        UMBPConnectorMetadata(stores=[BlockStoreBatch("r", (H1, H2), (1, 2), (0, 0), event_id=6)]),
    )
    meta = w.build_worker_meta()
    assert meta is not None and 6 in meta.store_results
    wait_idle(w)
    assert w.stats.take()["store_failures"] == 2
    assert w.staging is not None and w.staging.free_slots == w.staging.num_slots
    assert redis.Redis.from_url(redis_url).dbsize() == 0
    # Either way the scheduler is told the keys failed, and unpins the blocks.
    assert len(meta.store_results[6].failed_keys) == 2


def test_failed_scatter_makes_the_blocks_recompute(
    model_config: ModelConfig, redis_url: str
) -> None:
    src, src_caches = stored_source(model_config, redis_url, H3, 4, seed=3)
    dst, _ = make_worker(model_config, redis_url)
    gated = _gate(dst, "wait")
    gated.gate.set()
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H3,), (8,), (0,))]))
    assert wait_loaded(dst, "r2") == {8}
    assert dst.staging is not None and dst.staging.free_slots == dst.staging.num_slots


def test_load_without_an_engine_point_is_recomputed(
    model_config: ModelConfig, redis_url: str
) -> None:
    w, caches = make_worker(model_config, redis_url)
    gated = _gate(w)

    def no_point() -> object:
        raise RuntimeError("cannot record an event now")

    gated.engine_point = no_point  # type: ignore[method-assign]
    step(w, UMBPConnectorMetadata(loads=[BlockLoadBatch("r9", (H1, H2), (5, 6), (0, 0))]))
    assert wait_loaded(w, "r9") == {5, 6}
    assert gated.scatter_after == []  # nothing was scattered


def test_a_value_of_another_block_is_never_loaded_and_only_invalid_values_are_removed(
    model_config: ModelConfig, redis_url: str
) -> None:
    import redis as redis_py

    src, _ = stored_source(model_config, redis_url, H1, 3, seed=7)
    stored_source(model_config, redis_url, H2, 4, seed=8)
    r = redis_py.Redis.from_url(redis_url)
    k1, k2 = src.codec.key(H1, 0), src.codec.key(H2, 0)
    r.copy(k1, k2, replace=True)  # block 2's key now holds block 1's (valid) value
    k3 = src.codec.key(H3, 0)
    r.set(k3, b"someone else's string")  # WRONGTYPE for HMGET: an error, not invalid
    dst, dst_caches = make_worker(model_config, redis_url)
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H2, H3), (9, 10), (0, 0))]))
    assert wait_loaded(dst, "r2") == {9, 10}
    for name in dst_caches:
        assert not page_bytes(dst_caches[name], 9, NB).any()  # nothing was scattered
    assert not r.exists(k2)  # the invalid value was removed, so a store replaces it
    assert r.get(k3) == b"someone else's string"  # an error reply deletes nothing
    # The error is reported to the scheduler (its quarantine), once; the invalid value
    # is gone (a miss until stored again), nothing to quarantine.
    meta = dst.build_worker_meta()
    assert meta is not None and meta.failed_loads == (H3,) and meta.failed_requests == ("r2",)
    assert meta.removed_blocks == (H2,)  # for KV cache events: Redis no longer holds it
    assert dst.build_worker_meta() is None
    # A missing value is not a failure of an object: nothing to quarantine; it is
    # reported removed (its stored marker goes: other engines miss instead of failing).
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r3", (H4,), (11,), (0,))]))
    assert wait_loaded(dst, "r3") == {11}
    meta = dst.build_worker_meta()
    assert meta is not None and meta.removed_blocks == (H4,) and meta.failed_loads == ()
    # The engine recomputes H3 and stores it again: the same WRONGTYPE, still failed.
    # Once the foreign key is gone the store succeeds and H3 is reported repaired.
    for event_id in (5, 6):
        step(
            dst,
            UMBPConnectorMetadata(
                stores=[BlockStoreBatch("r4", (H3,), (10,), (0,), event_id=event_id)]
            ),
        )
        wait_idle(dst)
        meta = dst.build_worker_meta()
        assert meta is not None
        assert meta.repaired_loads == (() if event_id == 5 else (H3,))
        r.delete(k3)


def test_unplannable_loads_fail_at_once_and_cancel_bookkeeping_is_bounded(
    model_config: ModelConfig, redis_url: str
) -> None:
    w, _ = make_worker(model_config, redis_url)
    bad = BlockLoadBatch("r5", (b"", b""), (2, 3), (0, 0), fail_all=True)
    step(w, UMBPConnectorMetadata(loads=[bad]))
    assert wait_loaded(w, "r5") == {2, 3}
    # Cancellations of requests with nothing in flight are not remembered.
    for i in range(1000):
        step(w, UMBPConnectorMetadata(cancelled_requests=[f"gone{i}"]))
    assert not w._cancelled and not w._loading


def test_host_kv_loads_receive_straight_into_the_blocks_without_staging(
    model_config: ModelConfig, redis_url: str
) -> None:
    import redis as redis_py

    src1, caches1 = stored_source(model_config, redis_url, H1, 3, seed=21)
    src2, caches2 = stored_source(model_config, redis_url, H2, 5, seed=22)
    one_slot = object_size(model_config, redis_url)
    # One staging slot: through staging a two-block load could not even start.
    dst, dst_caches = make_worker(model_config, redis_url, max_staging_bytes=one_slot)
    assert dst.staging is not None and dst.staging.num_slots == 1
    views = dst.loader.receive_views(
        [dst._plan(p, "r") for p in BlockLoadBatch("r", (H1,), (9,), (0,))]
    )
    assert views is not None and sum(v.nbytes for v in views[0]) == one_slot
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r2", (H1, H2), (9, 10), (0, 0))]))
    assert wait_loaded(dst, "r2") == set()
    assert dst.staging.free_slots == 1
    for name in dst_caches:
        assert torch.equal(page_bytes(dst_caches[name], 9, NB), page_bytes(caches1[name], 3, NB))
        assert torch.equal(page_bytes(dst_caches[name], 10, NB), page_bytes(caches2[name], 5, NB))
    # A value whose body fails its checksum is received into the block too, but the
    # block is reported failed (vLLM recomputes it before reading it) and the value
    # is removed.
    r = redis_py.Redis.from_url(redis_url)
    k1 = src1.codec.key(H1, 0)
    body = bytearray(raw(r.hget(k1, "b")))
    body[100] ^= 0xFF
    r.hset(k1, "b", bytes(body))
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r3", (H1, H2), (11, 12), (0, 0))]))
    assert wait_loaded(dst, "r3") == {11}
    assert not r.exists(k1)
    for name in dst_caches:
        assert torch.equal(page_bytes(dst_caches[name], 12, NB), page_bytes(caches2[name], 5, NB))


def test_the_switch_interval_is_short_only_while_loads_are_in_flight(
    model_config: ModelConfig, redis_url: str
) -> None:
    import sys

    before = sys.getswitchinterval()
    try:
        sys.setswitchinterval(0.005)  # Python's default
        stored_source(model_config, redis_url, H1, 3, seed=31)
        w, _ = make_worker(model_config, redis_url)
        assert sys.getswitchinterval() == 0.005  # no load in flight: left alone
        seen: list[float] = []
        load = w.plane.load

        def recording(*args: Any, **kw: Any) -> Any:
            seen.append(sys.getswitchinterval())
            return load(*args, **kw)

        w.plane.load = recording  # type: ignore[method-assign]
        step(w, UMBPConnectorMetadata(loads=[BlockLoadBatch("r", (H1,), (9,), (0,))]))
        assert wait_loaded(w, "r") == set()
        assert seen and all(abs(v - 0.0002) < 1e-9 for v in seen)
        # The transfer thread restores it as its load ends (after reporting it).
        wait_until(
            lambda: sys.getswitchinterval() == 0.005,
            TRANSFER_S,
            what=lambda: f"the switch interval restored (now {sys.getswitchinterval()})",
        )
        # Nested holds: the last release restores; 0 never changes it; never lengthened.
        from umbp_redis.engine.switch_interval import LoadSwitchInterval

        scope = LoadSwitchInterval()
        assert scope.hold(0.2) and scope.hold(0.2)
        scope.release()
        assert abs(sys.getswitchinterval() - 0.0002) < 1e-9
        scope.release()
        assert sys.getswitchinterval() == 0.005
        assert not scope.hold(0)
        sys.setswitchinterval(0.0001)
        assert scope.hold(1)
        assert abs(sys.getswitchinterval() - 0.0001) < 1e-9
        scope.release()
        assert abs(sys.getswitchinterval() - 0.0001) < 1e-9
    finally:
        sys.setswitchinterval(before)


def returns_while_frozen(server: EmbeddedRedis, run: Callable[[], None]) -> None:
    """Run ``run()`` (a step) with ``server`` frozen (answering nothing): it must
    return before the server answers again. With ``op_timeout_s`` an hour, only the
    load's deadline (``sync_load_timeout_s``) can have ended it."""
    with FrozenServer(server) as frozen:
        run()
        assert frozen.still_frozen, "the step waited for the server, not for its deadline"


def test_a_sync_load_holds_up_the_step_at_most_sync_load_timeout_s(
    model_config: ModelConfig, own_redis: EmbeddedRedis
) -> None:
    """A server that stops answering (here frozen) holds up a sync load until
    ``sync_load_timeout_s``, not ``op_timeout_s``; its blocks are recomputed."""

    stored_source(model_config, own_redis.url, H1, 3, seed=9)
    w, _ = make_worker(model_config, own_redis.url, op_timeout_s=3600, sync_load_timeout_s=SYNC_S)
    sync = BlockLoadBatch("r", (H1,), (4,), (0,), load_async=False)
    step(w, UMBPConnectorMetadata(loads=[sync]))  # the connection is made, the load works
    assert w.get_block_ids_with_load_errors() == set()
    returns_while_frozen(own_redis, lambda: step(w, UMBPConnectorMetadata(loads=[sync])))
    assert w.get_block_ids_with_load_errors() == {4}
    meta = w.build_worker_meta()
    assert meta is not None and meta.sync_failed_requests == ("r",)
    assert w.take_finished_loads() == (set(), set())  # sync: never reported finished


def test_a_sync_load_that_finds_an_invalid_value_removes_it_within_sync_load_timeout_s(
    model_config: ModelConfig, own_redis: EmbeddedRedis
) -> None:
    """Removing invalid values is part of the sync load: a server that stops answering
    after answering the load (frozen before the delete) holds up the step until the
    load's deadline (``sync_load_timeout_s``), not ``op_timeout_s`` (an hour here): the
    step returns with the server still frozen; the block is recomputed."""
    import redis

    src, _ = stored_source(model_config, own_redis.url, H1, 3, seed=9)
    r = redis.Redis.from_url(own_redis.url)
    key = src.codec.key(H1, 0)
    body = bytearray(raw(r.hget(key, "b")))
    body[7] ^= 0xFF
    r.hset(key, "b", bytes(body))
    w, _ = make_worker(model_config, own_redis.url, op_timeout_s=3600, sync_load_timeout_s=SYNC_S)
    inner = w.plane
    frozen = FrozenServer(own_redis)
    deletes: list[tuple[float | None, float]] = []  # (its deadline, when it was called)

    class FreezesBeforeDelete:
        """The worker's plane, with the server frozen just before a delete."""

        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def delete(self, keys: Any, *, deadline: float | None = None) -> int:
            deletes.append((deadline, time.monotonic()))
            frozen.freeze()
            return int(inner.delete(keys, deadline=deadline))

    w.plane = FreezesBeforeDelete()  # type: ignore[assignment]
    try:
        step(
            w,
            UMBPConnectorMetadata(loads=[BlockLoadBatch("r", (H1,), (4,), (0,), load_async=False)]),
        )
        assert len(deletes) == 1, "the load never found the value invalid"
        assert frozen.still_frozen, "the delete waited for the server, not for the deadline"
    finally:
        frozen.thaw()
    # The delete ran by the load's own deadline, set when the load began (before it).
    ((deadline, called_at),) = deletes
    assert deadline is not None and deadline <= called_at + SYNC_S
    assert w.get_block_ids_with_load_errors() == {4}
    assert w.stats.take()["sync_loads"] == 1
    # A sync load the scheduler could not plan is counted as a sync load too.
    unplanned = BlockLoadBatch("u", (H2,), (5,), (0,), fail_all=True, load_async=False)
    step(w, UMBPConnectorMetadata(loads=[unplanned]))
    counts = w.stats.take()
    assert (counts["sync_loads"], counts["load_failures"]) == (1, 1)
    assert w.get_block_ids_with_load_errors() == {5}


class EventLog:
    """What happened, in order, noted from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.events: list[str] = []

    def note(self, what: str) -> int:
        """Note ``what``; its position in the log."""
        with self._lock:
            self.events.append(what)
            return len(self.events) - 1


class RecordingCopier:
    """The worker's own copier, recording each scatter (its blocks and when it started:
    its position in ``log``); with ``fail_call`` set, that scatter call (1-based) raises
    instead. With ``device`` it hands out engine points as an asynchronous (GPU) copier
    does; the host copier it wraps gives None (its copies are synchronous)."""

    name = "recording"

    def __init__(self, inner, log: EventLog, fail_call: int = 0, device: bool = True) -> None:  # type: ignore[no-untyped-def]
        self.inner = inner
        self.log = log
        self.fail_call = fail_call
        self.device = device
        # (its position in the log, its blocks) per scatter
        self.scatters: list[tuple[int, tuple[int, ...]]] = []

    def engine_point(self) -> object | None:
        return object() if self.device else self.inner.engine_point()

    def gather(self, plan):  # type: ignore[no-untyped-def]
        return self.inner.gather(plan)

    def scatter(self, plan, after=None):  # type: ignore[no-untyped-def]
        self.scatters.append((self.log.note("scatter"), plan.block_ids))
        if len(self.scatters) == self.fail_call:
            raise RuntimeError("kernel launch failed")
        return self.inner.scatter(plan, after)


def stored_blocks(
    model_config: ModelConfig, url: str, hashes: list[bytes], seed: int
) -> dict[str, torch.Tensor]:
    """The KV caches of a worker whose random blocks 0..n-1 were stored under ``hashes``."""
    n = len(hashes)
    src, caches = make_worker(model_config, url)
    fill_random(caches, seed=seed)
    batch = BlockStoreBatch("s", tuple(hashes), tuple(range(n)), (0,) * n, event_id=9)
    step(src, UMBPConnectorMetadata(stores=[batch]))
    wait_idle(src)
    return caches


def _staged_loader(model_config: ModelConfig, url: str, fail_call: int = 0, device: bool = True):  # type: ignore[no-untyped-def]
    """A worker that loads through staging, one connection, one object per window half,
    its copier recorded and the end of its plane's loads noted in the same log (the
    positions in it say what came first)."""
    size = object_size(model_config, url)
    w, caches = make_worker(model_config, url, max_inflight_bytes=2 * size, transfer_connections=1)
    log = EventLog()
    rec = RecordingCopier(w.copier, log, fail_call, device)
    w.copier = rec  # type: ignore[assignment]
    inner = w.plane
    load_ends: list[int] = []

    class NotedPlane:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def load(self, *args: Any, **kw: Any) -> Any:
            out = inner.load(*args, **kw)
            load_ends.append(log.note("load returned"))
            return out

    w.plane = NotedPlane()  # type: ignore[assignment]
    return w, caches, rec, load_ends


@pytest.mark.parametrize("device", [True, False])
def test_a_staged_load_copies_each_window_while_later_ones_arrive(
    model_config: ModelConfig, redis_url: str, device: bool
) -> None:
    """Part 1 of issue 17: through staging with an asynchronous (device) copier, the
    copies of received blocks start while the rest of the batch is still being received,
    not after it; synchronous host copies run once, after the batch (they would hold up
    the receiving thread)."""
    hashes = [bytes([0x30 + i]) * 32 for i in range(6)]
    src_caches = stored_blocks(model_config, redis_url, hashes, seed=31)
    dst, dst_caches, rec, load_ends = _staged_loader(model_config, redis_url, device=device)
    dest = tuple(range(8, 14))
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r", tuple(hashes), dest, (0,) * 6)]))
    assert wait_loaded(dst, "r") == set()
    assert sorted(b for _, blocks in rec.scatters for b in blocks) == list(dest)
    if device:
        assert len(rec.scatters) >= 3  # a copy per window, not one for the batch
        assert rec.scatters[0][0] < load_ends[0]  # started before the last value was in
    else:
        assert len(rec.scatters) == 1 and rec.scatters[0][0] > load_ends[0]
    for name in src_caches:
        for s, d in zip(range(6), dest, strict=True):
            assert torch.equal(
                page_bytes(dst_caches[name], d, NB), page_bytes(src_caches[name], s, NB)
            )


def test_a_failed_copy_fails_only_its_blocks_and_does_not_quarantine_them(
    model_config: ModelConfig, redis_url: str
) -> None:
    hashes = [bytes([0x40 + i]) * 32 for i in range(4)]
    src_caches = stored_blocks(model_config, redis_url, hashes, seed=41)
    dst, dst_caches, rec, _ = _staged_loader(model_config, redis_url, fail_call=2)
    dest = (8, 9, 10, 11)
    step(dst, UMBPConnectorMetadata(loads=[BlockLoadBatch("r", tuple(hashes), dest, (0,) * 4)]))
    failed = wait_loaded(dst, "r")
    assert failed == set(rec.scatters[1][1]) and failed  # the blocks of the failed copy
    for s, d in zip(range(4), dest, strict=True):
        if d not in failed:
            for name in src_caches:
                assert torch.equal(
                    page_bytes(dst_caches[name], d, NB), page_bytes(src_caches[name], s, NB)
                )
    meta = dst.build_worker_meta()
    assert meta is None or meta.failed_loads == ()  # the values are fine: no quarantine
    assert dst.staging is not None and dst.staging.free_slots == dst.staging.num_slots


# --- sync loads by layer ----------------------------------------------------------------

WIDE = 8  # KV heads: 256 KiB a layer, so an object of 3 layers is stored in 3 parts


def forward_step(w: UMBPWorker, meta: UMBPConnectorMetadata) -> None:
    """A step as vLLM runs it with a forward pass: each attention layer waits for its load."""
    w.bind(meta)
    w.start_load_kv()
    for name in LAYERS:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    w.clear()


def _layered_pair(
    model_config: ModelConfig, url: str, blocks: int = 4, **extra: Any
) -> tuple[UMBPWorker, dict, UMBPWorker, dict, list[bytes]]:  # type: ignore[type-arg]
    """A source that stored ``blocks`` random blocks (ids 1..) and a fresh destination."""
    hashes = [bytes([0x40 + i]) * 32 for i in range(blocks)]
    src, src_caches = make_worker(model_config, url, heads=WIDE)
    fill_random(src_caches, seed=21)
    ids = tuple(range(1, blocks + 1))
    step(
        src,
        UMBPConnectorMetadata(
            stores=[BlockStoreBatch("s", tuple(hashes), ids, (0,) * blocks, event_id=3)]
        ),
    )
    wait_idle(src)
    dst, dst_caches = make_worker(model_config, url, heads=WIDE, **extra)
    assert src.planner.layouts[0].part_layers() == tuple((name,) for name in LAYERS)
    return src, src_caches, dst, dst_caches, hashes


def test_a_sync_load_by_layer_lets_each_layer_go_once_its_part_is_in(
    model_config: ModelConfig, redis_url: str
) -> None:
    """start_load_kv returns at once; when wait_for_layer_load(layer) returns, that
    layer's page of every block is the source's; the whole load is valid at the end."""
    import redis

    _, src_caches, w, caches, hashes = _layered_pair(model_config, redis_url)
    key = w.codec.key(hashes[0], 0)
    assert sorted(redis.Redis.from_url(redis_url).hkeys(key)) == [b"b", b"b1", b"b2", b"h"]
    ids = (5, 6, 7, 8)
    w.bind(
        UMBPConnectorMetadata(
            loads=[BlockLoadBatch("r", tuple(hashes), ids, (0,) * 4, load_async=False)]
        )
    )
    w.start_load_kv()
    assert len(w.layer_loads.gates) == 1  # running alongside the forward pass
    for name in LAYERS:
        w.wait_for_layer_load(name)
        for i, b in enumerate(ids):
            assert torch.equal(page_bytes(caches[name], b), page_bytes(src_caches[name], i + 1))
    w.wait_for_save()
    w.clear()
    assert w.get_block_ids_with_load_errors() == set()
    counts = w.stats.take()
    assert (counts["blocks_loaded"], counts["sync_loads"]) == (4, 1)
    assert counts["layer_wait_ms"] > 0  # what the layers waited, for the metrics
    assert counts["load_s"] and counts["load_s"][0] > 0  # the load's seconds, for histograms
    # The scheduler hears what the load cost (its bytes and seconds), and nothing else.
    meta = w.build_worker_meta()
    assert meta is not None
    assert meta.load_times == ((counts["bytes_loaded"], counts["load_s"][0], True),)
    assert meta == UMBPConnectorWorkerMetadata(load_times=meta.load_times)


def test_a_load_by_layer_the_forward_did_not_wait_for_is_recomputed(
    model_config: ModelConfig, redis_url: str
) -> None:
    """A forward pass that skips wait_for_layer_load for a layer may have read it too
    early: every block of the load is reported failed, the step stores nothing, and
    sync loads then run before the forward pass."""
    _, _, w, caches, hashes = _layered_pair(model_config, redis_url)
    fill_random(caches, seed=3)
    load = BlockLoadBatch("r", tuple(hashes), (5, 6, 7, 8), (0,) * 4, load_async=False)
    store = BlockStoreBatch("r", (H4,), (9,), (0,), event_id=4)
    w.bind(UMBPConnectorMetadata(loads=[load], stores=[store]))
    w.start_load_kv()
    w.wait_for_layer_load(LAYERS[0])  # the other layers are not waited for
    w.wait_for_save()
    w.clear()
    assert w.get_block_ids_with_load_errors() == {5, 6, 7, 8}
    meta = w.build_worker_meta()
    assert meta is not None and meta.sync_failed_requests == ("r",)
    assert meta.store_results[4].failed_keys  # dropped: computed over the failed load
    assert not w.load_by_layer and meta.layer_loads_off  # the scheduler hears of it once
    assert not w.handshake_metadata().loads_by_layer
    w.bind(UMBPConnectorMetadata(loads=[load]))
    w.start_load_kv()  # now whole, before the forward pass
    assert not w.layer_loads.gates
    w.wait_for_save()
    w.clear()
    assert w.get_block_ids_with_load_errors() == set()


def test_a_load_by_layer_of_a_damaged_value_fails_its_blocks_and_the_steps_stores(
    model_config: ModelConfig, redis_url: str
) -> None:
    import redis

    _, _, w, _, hashes = _layered_pair(model_config, redis_url)
    r = redis.Redis.from_url(redis_url)
    key = w.codec.key(hashes[2], 0)
    body = bytearray(raw(r.hget(key, "b2")))
    body[11] ^= 0xFF
    r.hset(key, "b2", bytes(body))
    load = BlockLoadBatch("r", tuple(hashes), (5, 6, 7, 8), (0,) * 4, load_async=False)
    store = BlockStoreBatch("r", (H4,), (9,), (0,), event_id=5)
    forward_step(w, UMBPConnectorMetadata(loads=[load], stores=[store]))
    assert w.get_block_ids_with_load_errors() == {7}
    meta = w.build_worker_meta()
    assert meta is not None and meta.store_results[5].failed_keys
    assert not r.exists(key)  # the damaged value was removed
    assert not r.exists(w.codec.key(H4, 0))


def test_a_load_by_layer_holds_each_layer_up_at_most_until_sync_load_timeout_s(
    model_config: ModelConfig, own_redis: EmbeddedRedis
) -> None:
    """A server that stops answering holds the forward pass's layers up until the
    load's deadline in all, not op_timeout_s; the blocks are recomputed."""

    _, _, w, _, hashes = _layered_pair(
        model_config, own_redis.url, op_timeout_s=3600, sync_load_timeout_s=SYNC_S
    )
    load = BlockLoadBatch("r", tuple(hashes), (5, 6, 7, 8), (0,) * 4, load_async=False)
    forward_step(w, UMBPConnectorMetadata(loads=[load]))  # the connections are made
    assert w.get_block_ids_with_load_errors() == set()
    returns_while_frozen(own_redis, lambda: forward_step(w, UMBPConnectorMetadata(loads=[load])))
    assert w.get_block_ids_with_load_errors() == {5, 6, 7, 8}


def test_the_handshake_says_whether_sync_loads_run_by_layer(
    model_config: ModelConfig, redis_url: str
) -> None:
    """Host KV caches whose objects are stored in parts load by layer; objects stored
    whole, or load_by_layer off, do not (the scheduler then keeps large loads async)."""
    wide, _ = make_worker(model_config, redis_url, heads=WIDE)
    assert wide.handshake_metadata().loads_by_layer
    narrow, _ = make_worker(model_config, redis_url)  # 3 layers of 64 KiB: one part
    assert not narrow.handshake_metadata().loads_by_layer
    off, _ = make_worker(model_config, redis_url, heads=WIDE)
    off.load_by_layer = False  # as after a forward pass skipped a layer's wait
    assert not off.handshake_metadata().loads_by_layer
    staged, _ = make_worker(model_config, redis_url, heads=WIDE)
    staged.loader.direct_loads = False  # loads through staging, as on a GPU
    assert not staged.handshake_metadata().loads_by_layer
