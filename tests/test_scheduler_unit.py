"""Logic of the scheduler half, with a scripted data plane (no server, no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from kv_fixtures import attn_spec, vllm_layout_caches
from test_data_identity import make_vllm_config
from vllm.config import ModelConfig
from vllm.v1.kv_cache_layout import KVCacheLayout

from umbp_redis.config import validate_options
from umbp_redis.data import (
    RankTopology,
    StoreEventResult,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
)
from umbp_redis.scheduler import UMBPScheduler

BS = 128


class ScriptedDataPlane:
    """Answers lookups from a set of present keys; records what was asked."""

    def __init__(self, present: set[str] | None = None, fail: bool = False) -> None:
        self.present = present or set()
        self.fail = fail
        self.calls: list[list[str]] = []

    def lookup(self, keys):  # type: ignore[no-untyped-def]
        self.calls.append(list(keys))
        return None if self.fail else [k in self.present for k in keys]


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)


class FakeBlockPool:
    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]

    def touch(self, blocks):  # type: ignore[no-untyped-def]
        for b in blocks:
            b.ref_cnt += 1

    def free_blocks(self, blocks):  # type: ignore[no-untyped-def]
        for b in blocks:
            b.ref_cnt -= 1


@pytest.fixture(scope="module")
def model_config(tiny_model: Path) -> ModelConfig:
    return ModelConfig(model=str(tiny_model), dtype="bfloat16", max_model_len=1024)


def make_scheduler(
    model_config: ModelConfig,
    dp: ScriptedDataPlane,
    tp: int = 1,
    role: str = "kv_both",
    **extra: Any,
) -> UMBPScheduler:
    cfg = make_vllm_config(model_config, tp=tp, extra={"key_namespace": "unit", **extra})
    cfg.kv_transfer_config.kv_role = role
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    opts = validate_options(cfg.kv_transfer_config.kv_connector_extra_config)
    return UMBPScheduler(cfg, kv, opts, dataplane=dp)  # type: ignore[arg-type]


def request(n_tokens: int, rid: str = "r1") -> FakeRequest:
    return FakeRequest(rid, n_tokens, [bytes([i]) * 32 for i in range(n_tokens // BS)])


def test_counts_the_consecutive_prefix_whose_every_key_exists(model_config: ModelConfig) -> None:
    dp = ScriptedDataPlane()
    s = make_scheduler(model_config, dp)
    req = request(5 * BS + 10)
    assert s.codec is not None
    keys = [s.codec.key(h, 0) for h in req.block_hashes]
    dp.present = {keys[0], keys[1], keys[3]}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert len(dp.calls) == 1 and dp.calls[0] == keys  # one round trip, all blocks
    # Side-effect free: asked again, same answer.
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    # Beyond the local prefix hit only.
    assert s.get_num_new_matched_tokens(req, BS) == (BS, True)
    assert dp.calls[-1] == keys[1:]


def test_never_the_whole_prompt(model_config: ModelConfig) -> None:
    dp = ScriptedDataPlane()
    s = make_scheduler(model_config, dp)
    req = request(4 * BS)  # exactly 4 blocks: the last token must be computed
    assert s.codec is not None
    dp.present = {s.codec.key(h, 0) for h in req.block_hashes}
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_lookup_error_is_zero_hits(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane(fail=True))
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False)


def test_store_only_and_producer_never_look_up(model_config: ModelConfig) -> None:
    for kw in ({"enable_lookup": False}, {"role": "kv_producer"}):
        dp = ScriptedDataPlane()
        s = make_scheduler(model_config, dp, **kw)  # type: ignore[arg-type]
        assert s.get_num_new_matched_tokens(request(600), 0) == (0, False)
        assert dp.calls == []


def test_tp2_block_needs_every_rank_key(model_config: ModelConfig) -> None:
    dp = ScriptedDataPlane()
    s = make_scheduler(model_config, dp, tp=2)
    req = request(3 * BS + 1)
    assert s.codec is not None
    dp.present = {s.codec.rank_keys(req.block_hashes[0], 0)[0]}  # only tp0's shard
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert len(dp.calls[0]) == 2 * 3
    dp.present |= {k for h in req.block_hashes for k in s.codec.rank_keys(h, 0)}
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_derived_namespace_waits_for_the_workers(model_config: ModelConfig) -> None:
    cfg = make_vllm_config(model_config)
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    dp = ScriptedDataPlane()
    s = UMBPScheduler(cfg, kv, validate_options({}), dataplane=dp)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False) and not dp.calls
    s.adopt_handshake({(0, 0): UMBPHandshakeMetadata("abc123", RankTopology())})
    assert s.codec is not None and s.codec.namespace == "abc123"
    s.get_num_new_matched_tokens(request(600), 0)
    assert dp.calls and dp.calls[0][0].startswith("umbp:vllm:v1:abc123:")


def _step(new=(), cached=(), sched=None, preempted=None):  # type: ignore[no-untyped-def]
    cached = list(cached)
    return SimpleNamespace(
        scheduled_new_reqs=[
            SimpleNamespace(req_id=r, block_ids=b, num_computed_tokens=c) for r, b, c in new
        ],
        scheduled_cached_reqs=SimpleNamespace(
            req_ids=[r for r, _, _ in cached],
            new_block_ids=[b for _, b, _ in cached],
            num_computed_tokens=[c for _, _, c in cached],
            resumed_req_ids=set(),
        ),
        num_scheduled_tokens=sched or {},
        preempted_req_ids=preempted,
    )


def test_stores_complete_prompt_blocks_once_and_pins_until_reported(
    model_config: ModelConfig,
) -> None:
    dp = ScriptedDataPlane()
    s = make_scheduler(model_config, dp)
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    req = request(3 * BS + 40)
    s.get_num_new_matched_tokens(req, 0)
    # Chunked prefill: 200 tokens, then the rest.
    meta = s.build_connector_meta(_step(new=[("r1", ([5, 6, 7, 8],), 0)], sched={"r1": 200}))
    assert [list(b.block_ids) for b in meta.stores] == [[5]]
    assert pool.blocks[5].ref_cnt == 1 and s.pinned_blocks == 1
    # Only the pin holds block 5 (as if its request had finished): its report will
    # free it, so vLLM should wait for it rather than preempt; not while r1 holds it.
    assert s.has_pending_block_frees()
    pool.blocks[5].ref_cnt += 1
    assert not s.has_pending_block_frees()
    pool.blocks[5].ref_cnt -= 1
    meta2 = s.build_connector_meta(
        _step(cached=[("r1", None, 200)], sched={"r1": 3 * BS + 40 - 200})
    )
    assert [list(b.block_ids) for b in meta2.stores] == [[6, 7]]
    # Decode steps store nothing more (prompt blocks only by default).
    meta3 = s.build_connector_meta(_step(cached=[("r1", None, 3 * BS + 40)], sched={"r1": 1}))
    assert meta3.stores == []
    events = [b.event_id for b in meta.stores + meta2.stores]
    s.update_connector_output(
        SimpleNamespace(
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(
                {e: StoreEventResult(e) for e in events}
            ),
        )
    )
    assert s.pinned_blocks == 0 and all(b.ref_cnt == 0 for b in pool.blocks)
    assert not s.has_pending_block_frees()


def test_blocks_already_in_redis_are_not_sent_again(model_config: ModelConfig) -> None:
    dp = ScriptedDataPlane()
    s = make_scheduler(model_config, dp)
    req = request(3 * BS + 40)
    assert s.codec is not None
    dp.present = {s.codec.key(h, 0) for h in req.block_hashes[:2]}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4],), 2 * BS)], sched={"r1": BS + 40})
    )
    assert [list(b.block_ids) for b in meta.stores] == [[3]]


def test_consumer_never_stores_and_preemption_is_forwarded(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane(), role="kv_consumer")
    s.get_num_new_matched_tokens(request(600), 0)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4, 5],), 0)], sched={"r1": 600}, preempted={"r9"})
    )
    assert meta.stores == [] and meta.cancelled_requests == ["r9"]


def test_request_finished_never_delays_freeing(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane())
    req = request(600)
    s.get_num_new_matched_tokens(req, 0)
    assert s.request_finished(req) == (False, None)  # type: ignore[arg-type]
    assert "r1" not in s.requests


def test_plugin_registers_the_connector_name() -> None:
    from importlib.metadata import entry_points

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    eps = [e for e in entry_points(group="vllm.general_plugins") if e.name == "umbp_redis"]
    assert eps, "the vllm.general_plugins entry point is not installed"
    eps[0].load()()
    eps[0].load()()  # idempotent
    from umbp_redis.connector import UMBPRedisConnector

    assert KVConnectorFactory._registry["UMBPRedisConnector"]() is UMBPRedisConnector


def test_async_lookup_returns_none_until_done_and_discards_stale_answers(
    model_config: ModelConfig,
) -> None:
    import threading
    import time

    gate = threading.Event()

    class SlowDataPlane(ScriptedDataPlane):
        def lookup(self, keys):  # type: ignore[no-untyped-def]
            gate.wait(5)
            return super().lookup(keys)

    dp = SlowDataPlane()
    s = make_scheduler(model_config, dp, lookup_async=True)
    req = request(3 * BS + 5)
    assert s.codec is not None
    dp.present = {s.codec.key(h, 0) for h in req.block_hashes}
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)  # still running
    gate.set()
    deadline = time.monotonic() + 5
    while (res := s.get_num_new_matched_tokens(req, 0))[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert res == (3 * BS, True)
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)  # repeatable
    # The request changed (a local prefix hit now): the old answer is not reused.
    assert s.get_num_new_matched_tokens(req, BS) == (None, False)
    assert len(dp.calls) == 1 or dp.calls[-1] == [s.codec.key(h, 0) for h in req.block_hashes[1:]]
    s.shutdown()
