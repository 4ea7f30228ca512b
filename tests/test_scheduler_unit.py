"""Logic of the scheduler half, with a scripted data plane (no server, no engine)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import ktc, make_vllm_config
from keys import rank_prefixes
from kv_fixtures import LAYERS, attn_spec, vllm_layout_caches
from vllm.config import ModelConfig
from vllm.v1.core.kv_cache_manager import KVCacheBlocks
from vllm.v1.core.kv_cache_utils import KVCacheBlock
from vllm.v1.kv_cache_layout import KVCacheLayout
from vllm.v1.request import RequestStatus
from waiting import wait_until

from umbp_redis.data import (
    BlockIdentityCodec,
    RankTopology,
    StoreEventResult,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
)
from umbp_redis.data.keys import is_marker_key
from umbp_redis.engine.options import EngineOptions, parse_connector_options
from umbp_redis.engine.scheduler import UMBPScheduler
from umbp_redis.store.commands import ClusterLookupEncoder, LookupEncoder, RequestCountEncoder
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.slots import key_slot

BS = 128


def parse_commands(buf: bytes) -> list[list[bytes]]:
    """The RESP commands in ``buf`` (arrays of bulk strings)."""
    out, i = [], 0
    while i < len(buf):
        assert buf[i : i + 1] == b"*"
        j = buf.index(b"\r\n", i)
        n, i = int(buf[i + 1 : j]), j + 2
        args = []
        for _ in range(n):
            j = buf.index(b"\r\n", i)
            ln = int(buf[i + 1 : j])
            args.append(buf[j + 2 : j + 2 + ln])
            i = j + 2 + ln + 2
        out.append(args)
    return out


class ScriptedDataPlane:
    """Answers encoded lookups (EXPIRE/TOUCH) from a set of present value keys and
    request counts (INCR, and EXPIRE of a counter) from a dict; records the keys each
    lookup asked about, in order. A block's stored marker is present when it was
    written (``run_keyed``) or, once ``codec`` is set, when every rank's value key of
    the block is in ``present``."""

    def __init__(self, present: set[str] | None = None, fail: bool = False) -> None:
        self.present = present or set()
        self.fail = fail
        self.calls: list[list[str]] = []
        self.asked: dict[str, int] = {}  # request counters by key
        self.codec: BlockIdentityCodec | None = None
        self.markers: set[str] = set()  # markers written by run_keyed
        self.records: dict[str, bytes] = {}  # namespace records written by run_keyed
        self.keyed: list[list[bytes]] = []  # every run_keyed call's commands, parsed
        self.stream: list[list[bytes]] = []  # XADD commands of the fleet's announcements

    def has(self, key: str) -> bool:
        """Whether ``key`` (a value key or a stored marker) is present."""
        if key in self.present or key in self.markers:
            return True
        if self.codec is None or not is_marker_key(key):
            return False
        codec, hx = self.codec, key.rsplit(":", 1)[1]
        g = next((g for g in range(64) if key == codec.marker_prefix(g) + hx), None)
        return g is not None and all(
            k in self.present for k in codec.rank_keys(bytes.fromhex(hx), g)
        )

    def run_keyed(self, commands: list[tuple[bytes, bytes]], *, timeout: float) -> list[int] | None:
        if self.fail:
            return None
        out = []
        for _, buf in commands:
            (cmd,) = parse_commands(buf)
            self.keyed.append(cmd)
            key = cmd[1].decode()
            if cmd[0] == b"SET" and key.endswith(":model"):
                self.records[key] = cmd[2]
                out.append(1)
            elif cmd[0] == b"SET":
                self.markers.add(key)
                out.append(1)
            elif cmd[0] == b"XADD":
                self.stream.append(cmd)
                out.append(1)
            elif key.endswith(":announced"):  # EXPIRE of the announcement stream
                out.append(1)
            elif cmd[0] == b"UNLINK":
                out.append(int(self.has(key)))
                self.markers.discard(key)
            else:  # EXPIRE / TOUCH of a value key
                out.append(int(self.has(key)))
        return out

    def query_keyed(self, key: bytes, command: bytes, *, timeout: float) -> Any:
        """XRANGE of the announcement stream: no other engine's entries."""
        return None if self.fail else []

    lookup_mode = "standalone"

    def warm_up(self) -> None:
        pass

    def lookup_encoder(
        self, prefixes: list[bytes], *, refresh_ttl: bool, hash_hex_len: int
    ) -> LookupEncoder:
        return LookupEncoder(
            prefixes, refresh_ttl=refresh_ttl, ttl=b"86400", hash_hex_len=hash_hex_len
        )

    def request_count_encoder(self, prefix: bytes, *, hash_hex_len: int) -> RequestCountEncoder:
        return RequestCountEncoder(prefix, ttl=b"86400", hash_hex_len=hash_hex_len)

    def lookup_blocks(
        self, blocks: list[bytes], count: int, *, counted_from: int | None = None
    ) -> list[int] | None:
        return self.lookup_replies(b"".join(blocks), count)

    def lookup_replies(self, buf: bytes, count: int) -> list[int] | None:
        cmds = parse_commands(buf)
        asked, replies = [], []
        for cmd in cmds:
            if b":asked:" in cmd[1]:
                key = cmd[1].decode()
                if cmd[0] == b"INCR":
                    self.asked[key] = self.asked.get(key, 0) + 1
                replies.append(self.asked[key] if cmd[0] == b"INCR" else 1)
                continue
            keys = [k.decode() for k in (cmd[1:2] if cmd[0] == b"EXPIRE" else cmd[1:])]
            asked.extend(keys)
            replies.append(sum(self.has(k) for k in keys))
        assert len(replies) == count
        self.calls.append(asked)
        return None if self.fail else replies


@dataclass
class FakeRequest:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes] = field(default_factory=list)
    status: RequestStatus = RequestStatus.RUNNING
    num_computed_tokens: int = 0
    # What vLLM hashes besides the tokens (the KV events publish it).
    cache_salt: str | None = None
    num_output_tokens: int = 0
    lora_request: Any = None
    mm_features: list[Any] = field(default_factory=list)
    prompt_embeds: Any = None


class FakeBlockPool:
    def __init__(self, n: int) -> None:
        self.blocks = [SimpleNamespace(block_id=i, ref_cnt=0) for i in range(n)]
        self.null_block = self.blocks[0]  # as vLLM's: block 0, never a request's

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
    plane: ScriptedDataPlane,
    tp: int = 1,
    role: str = "kv_both",
    async_scheduling: bool = False,
    kv_events: bool = False,
    **extra: Any,
) -> UMBPScheduler:
    # Async loads unless a test asks otherwise: most tests here are about lookups.
    extra = {"key_namespace": "unit", "load_async": True, **extra}
    cfg = make_vllm_config(model_config, tp=tp, extra=extra)
    cfg.scheduler_config.async_scheduling = async_scheduling
    if kv_events:  # as vLLM's --kv-events-config sets it
        from vllm.config import KVEventsConfig

        cfg.kv_events_config = KVEventsConfig(enable_kv_cache_events=True)
    ktc(cfg).kv_role = role  # type: ignore[assignment]
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    options = parse_connector_options(ktc(cfg).kv_connector_extra_config)
    s = UMBPScheduler(cfg, kv, *options, plane=plane)  # type: ignore[arg-type]
    plane.codec = s.codec
    return s


def marker_keys(s: UMBPScheduler, hashes: list[bytes], group: int = 0) -> list[str]:
    """The stored markers of ``hashes`` in ``group``: the keys a lookup reads."""
    assert s.codec is not None
    return [s.codec.marker_prefix(group) + h.hex() for h in hashes]


def request(n_tokens: int, rid: str = "r1") -> FakeRequest:
    return FakeRequest(rid, n_tokens, [bytes([i]) * 32 for i in range(n_tokens // BS)])


def allocation(*groups: list[int]) -> KVCacheBlocks:
    """vLLM's allocation of the blocks ``groups`` (block ids of each cache group)."""
    return KVCacheBlocks(tuple([KVCacheBlock(b) for b in ids] for ids in groups))


def test_counts_the_consecutive_prefix_whose_every_key_exists(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    req = request(5 * BS + 10)
    assert s.codec is not None
    keys = [s.codec.key(h, 0) for h in req.block_hashes]
    plane.present = {keys[0], keys[1], keys[3]}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    # One round trip, one stored marker a block.
    assert len(plane.calls) == 1 and plane.calls[0] == marker_keys(s, req.block_hashes)
    # Side-effect free: asked again, same answer.
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    # Beyond the local prefix hit only; the locally cached block is refreshed in the
    # same round trip (its presence does not count).
    assert s.get_num_new_matched_tokens(req, BS) == (BS, True)
    assert plane.calls[-1] == marker_keys(s, req.block_hashes)
    plane.present.discard(keys[0])
    assert s.get_num_new_matched_tokens(req, BS) == (BS, True)


def test_never_the_whole_prompt(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    req = request(4 * BS)  # exactly 4 blocks: the last token must be computed
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_lookup_error_is_zero_hits(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane(fail=True))
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False)


def test_a_producer_never_looks_up(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, role="kv_producer")
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False)
    assert plane.calls == []
    # The option that once did the same names kv_role instead.
    with pytest.raises(ConfigError, match=r"enable_lookup.*kv_role.*kv_producer"):
        parse_connector_options({"enable_lookup": False})


def test_tp2_block_needs_every_rank_key(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2)
    req = request(3 * BS + 1)
    assert s.codec is not None
    plane.present = {s.codec.rank_keys(req.block_hashes[0], 0)[0]}  # only tp0's shard
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    # One key a block at any TP: its stored marker (present once every rank stored).
    assert plane.calls[0] == marker_keys(s, req.block_hashes[:3])
    plane.present |= {k for h in req.block_hashes for k in s.codec.rank_keys(h, 0)}
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def test_derived_namespace_waits_for_the_workers(model_config: ModelConfig) -> None:
    cfg = make_vllm_config(model_config)
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    plane = ScriptedDataPlane()
    s = UMBPScheduler(cfg, kv, *parse_connector_options({}), plane=plane)  # type: ignore[arg-type]
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False) and not plane.calls
    s.adopt_handshake({(0, 0): UMBPHandshakeMetadata("abc123", RankTopology())})
    assert s.codec is not None and s.codec.namespace == "abc123"
    s.get_num_new_matched_tokens(request(600), 0)
    assert plane.calls and plane.calls[0][0].startswith(
        BlockIdentityCodec("abc123").marker_prefix(0)
    )


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
        total_num_scheduled_tokens=sum((sched or {}).values()),
        preempted_req_ids=preempted,
    )


def test_stores_complete_prompt_blocks_once_and_pins_until_reported(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
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
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    req = request(3 * BS + 40)
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes[:2]}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4],), 2 * BS)], sched={"r1": BS + 40})
    )
    assert [list(b.block_ids) for b in meta.stores] == [[3]]


def _step_of_a_sync_load(
    s: UMBPScheduler, plane: ScriptedDataPlane
) -> tuple[FakeRequest, UMBPConnectorMetadata]:
    """A request of 4 blocks and 40 tokens, 2 blocks in Redis, in blocks 1-5; the meta
    of its first step (the sync load of blocks 1-2, computing the rest)."""
    req = request(4 * BS + 40)
    assert s.codec is not None
    plane.present = {k for h in req.block_hashes[:2] for k in s.codec.rank_keys(h, 0)}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, False)
    ids = allocation([1, 2, 3, 4, 5])
    s.update_state_after_alloc(req, ids, 2 * BS)  # type: ignore[arg-type]
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4, 5],), 2 * BS)], sched={"r1": 2 * BS + 40})
    )
    return req, meta


@pytest.mark.parametrize(("tp", "async_scheduling"), [(1, False), (2, False), (2, True)])
def test_with_several_ranks_a_sync_loads_step_stores_its_blocks_once_its_outcome_is_in(
    model_config: ModelConfig, tp: int, async_scheduling: bool
) -> None:
    """A rank whose sync load failed drops its stores of that step, but with TP the
    other ranks computed the same blocks from its garbage: the blocks a request computes
    in the step of its sync load are planned once vLLM has applied that step's output
    (and rolled a failed request back): the next step, or the one after with async
    scheduling. One rank plans them at once (its worker drops them itself)."""
    plane = ScriptedDataPlane()
    s = make_scheduler(
        model_config, plane, tp=tp, load_async=False, async_scheduling=async_scheduling
    )
    req, meta = _step_of_a_sync_load(s, plane)
    assert [b.load_async for b in meta.loads] == [False]
    planned = [[list(b.block_ids) for b in meta.stores]]
    for n in range(2):
        step = _step(cached=[("r1", None, 4 * BS + 40 + n)], sched={"r1": 1})
        planned.append([list(b.block_ids) for b in s.build_connector_meta(step).stores])
    wait = 0 if tp == 1 else 2 if async_scheduling else 1
    assert planned == [[[3, 4]] if i == wait else [] for i in range(3)]


@pytest.mark.parametrize("async_scheduling", [False, True])
@pytest.mark.parametrize(
    ("status", "stored"),
    [
        (RequestStatus.FINISHED_LENGTH_CAPPED, True),
        (RequestStatus.FINISHED_STOPPED, True),
        (RequestStatus.FINISHED_ABORTED, False),
        (RequestStatus.FINISHED_ERROR, False),
    ],
)
def test_a_request_that_ends_while_its_stores_are_held_stores_them_if_it_stopped(
    model_config: ModelConfig, async_scheduling: bool, status: RequestStatus, stored: bool
) -> None:
    """With several ranks, a request that ends in the step of its sync load (one output
    token) before its held stores went out: stopped by its output (vLLM has applied the
    step and rolled back failed loads), its blocks go out with the next step, pinned
    until reported; aborted or failed, nothing is stored."""
    plane = ScriptedDataPlane()
    s = make_scheduler(
        model_config, plane, tp=2, load_async=False, async_scheduling=async_scheduling
    )
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    req, meta = _step_of_a_sync_load(s, plane)
    assert [b.load_async for b in meta.loads] == [False] and meta.stores == []
    if async_scheduling:  # the next step was scheduled before the output came back
        step = _step(cached=[("r1", None, 4 * BS + 40)], sched={"r1": 1})
        assert s.build_connector_meta(step).stores == []
    req.status, req.num_computed_tokens = status, 4 * BS + 40 + int(async_scheduling)
    assert s.request_finished(req) == (False, None)  # type: ignore[arg-type]
    planned = [list(b.block_ids) for b in s.build_connector_meta(_step()).stores]
    assert planned == ([[3, 4]] if stored else [])
    assert [b.ref_cnt for b in pool.blocks[3:5]] == ([1, 1] if stored else [0, 0])
    assert s.build_connector_meta(_step()).stores == []  # once


def test_consumer_never_stores_and_preemption_is_forwarded(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane(), role="kv_consumer")
    s.get_num_new_matched_tokens(request(600), 0)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4, 5],), 0)], sched={"r1": 600}, preempted={"r9"})
    )
    assert meta.stores == [] and meta.cancelled_requests == ["r9"]


def test_a_finished_request_is_freed_at_once_its_store_sources_stay_pinned(
    model_config: ModelConfig,
) -> None:
    """vLLM frees a finished request's blocks at once (no delayed free); the blocks its
    stores still read stay allocated by the connector's own pins until reported."""
    s = make_scheduler(model_config, ScriptedDataPlane())
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    req = request(2 * BS + 40)
    s.get_num_new_matched_tokens(req, 0)
    meta = s.build_connector_meta(_step(new=[("r1", ([5, 6, 7],), 0)], sched={"r1": 2 * BS + 40}))
    assert [list(b.block_ids) for b in meta.stores] == [[5, 6]]
    delay_free, params = s.request_finished(req)  # type: ignore[arg-type]
    assert delay_free is False and params is None and "r1" not in s.requests
    # vLLM drops its own references now; the pins alone keep 5 and 6 allocated.
    assert [pool.blocks[b].ref_cnt for b in (5, 6, 7)] == [1, 1, 0]
    assert s.has_pending_block_frees()  # vLLM waits for the report rather than preempt
    (batch,) = meta.stores
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(
                {batch.event_id: StoreEventResult(batch.event_id)}
            ),
        )
    )
    assert s.pinned_blocks == 0 and pool.blocks[5].ref_cnt == pool.blocks[6].ref_cnt == 0


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

    gate = threading.Event()

    class SlowDataPlane(ScriptedDataPlane):
        def lookup_replies(self, buf: bytes, count: int) -> list[int] | None:
            gate.wait(5)
            return super().lookup_replies(buf, count)

    plane = SlowDataPlane()
    s = make_scheduler(model_config, plane, lookup_async=True)
    req = request(3 * BS + 5)
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)
    assert s.get_num_new_matched_tokens(req, 0) == (None, False)  # still running
    gate.set()
    res = wait_until(
        lambda: (r := s.get_num_new_matched_tokens(req, 0))[0] is not None and r,
        5,
        what="the lookup's answer",
    )
    assert res == (3 * BS, True)
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)  # repeatable
    # The request changed (a local prefix hit now): the old answer is not reused.
    assert s.get_num_new_matched_tokens(req, BS) == (None, False)
    assert len(plane.calls) == 1 or plane.calls[-1] == [s.codec.key(h, 0) for h in req.block_hashes]
    s.shutdown()


# --- integrity and robustness (issue: never a wrong token, never a stalled scheduler) ---


def test_keys_are_built_once_per_block(
    model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from umbp_redis.store.commands import LookupEncoder

    built: list[bytes] = []
    real = LookupEncoder.encode

    def counting(self, hash_hex):  # type: ignore[no-untyped-def]
        built.append(hash_hex)
        return real(self, hash_hex)

    monkeypatch.setattr(LookupEncoder, "encode", counting)
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2)
    req = request(4 * BS + 5)
    req.block_hashes = req.block_hashes[:2]  # the rest arrive later
    s.get_num_new_matched_tokens(req, 0)
    assert len(built) == 2
    s.get_num_new_matched_tokens(req, 0)
    assert len(built) == 2  # asked again: nothing rebuilt
    req.block_hashes = request(4 * BS + 5).block_hashes
    s.get_num_new_matched_tokens(req, 0)
    assert len(built) == 4  # only the new blocks
    assert len(plane.calls[-1]) == 4  # one marker a block at TP=2, all in one round trip


def test_encoded_lookups_equal_the_reference_encoding() -> None:
    from umbp_redis.store.commands import LookupEncoder, lookup_commands

    prefixes = rank_prefixes("ns", tp_size=2)
    hx = bytes(range(32)).hex().encode()
    for refresh in (True, False):
        enc = LookupEncoder(prefixes, refresh_ttl=refresh, ttl=b"3600", hash_hex_len=len(hx))
        keys = [p + hx for p in prefixes]
        want, replies = lookup_commands(keys, refresh_ttl=refresh, ttl=b"3600")
        assert enc.encode(hx) == want and enc.replies == replies
        # On a cluster each key is its own command (keys of a block live in many slots).
        cenc = ClusterLookupEncoder(
            prefixes, refresh_ttl=refresh, ttl=b"3600", hash_hex_len=len(hx)
        )
        block = cenc.encode(hx)
        assert cenc.replies == len(keys)
        assert list(block.cmds) == [
            lookup_commands([k], refresh_ttl=refresh, ttl=b"3600")[0] for k in keys
        ]
        assert list(block.slots) == [key_slot(k) for k in keys]
    with pytest.raises(ValueError, match="expected 64"):
        enc.encode(b"ab")


def test_without_ttl_refresh_one_touch_per_block_checks_every_rank(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2, refresh_ttl_on_lookup=False)
    req = request(3 * BS + 1)
    assert s.codec is not None
    plane.present = {k for h in req.block_hashes[:2] for k in s.codec.rank_keys(h, 0)}
    plane.present.add(s.codec.rank_keys(req.block_hashes[2], 0)[1])  # one shard of block 2
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert plane.calls[-1] == marker_keys(s, req.block_hashes[:3])


def test_blocks_recomputed_after_a_failed_load_are_stored_again(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    req = request(4 * BS + 40)
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes[:3]}
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    blocks = allocation([1, 2, 3, 4, 5])
    s.update_state_after_alloc(req, blocks, 3 * BS)
    # Block 1 was invalid: vLLM recomputes from its start (num_computed_tokens = BS).
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4, 5],), BS)], sched={"r1": 3 * BS + 40})
    )
    assert [list(b.block_ids) for b in meta.stores] == [[2, 3, 4]]
    # A load that succeeded stores nothing again.
    s2 = make_scheduler(model_config, plane)
    assert s2.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
    s2.update_state_after_alloc(req, blocks, 3 * BS)
    meta = s2.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4, 5],), 3 * BS)], sched={"r1": BS + 40})
    )
    assert [list(b.block_ids) for b in meta.stores] == [[4]]


def test_fail_policy_is_overridden_with_a_warning(
    model_config: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_vllm_config(model_config, extra={"key_namespace": "unit"})
    assert ktc(cfg).kv_load_failure_policy == "fail"  # vLLM's default
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    UMBPScheduler(cfg, kv, *parse_connector_options({}), plane=ScriptedDataPlane())  # type: ignore[arg-type]
    assert ktc(cfg).kv_load_failure_policy == "recompute"
    assert any(
        "kv_load_failure_policy" in r.getMessage() and r.levelname == "WARNING"
        for r in caplog.records
    )


def test_weak_block_hash_is_warned_about(
    model_config: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    cfg = make_vllm_config(model_config, extra={"key_namespace": "unit"})
    cfg.cache_config.prefix_caching_hash_algo = "xxhash"
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    UMBPScheduler(cfg, kv, *parse_connector_options({}), plane=ScriptedDataPlane())  # type: ignore[arg-type]
    assert any("not collision resistant" in r.getMessage() for r in caplog.records)


def test_a_failing_hook_is_a_miss_not_an_exception(
    model_config: ModelConfig, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(ScriptedDataPlane):
        def lookup_replies(self, buf: bytes, count: int) -> list[int] | None:
            raise RuntimeError("bug")

    s = make_scheduler(model_config, Broken())
    req = request(3 * BS + 5)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    assert s.errors == 1 and any(r.levelname == "ERROR" for r in caplog.records)
    # Counted in the stats as a connector bug, once.
    assert s.take_stats()["unexpected_errors"] == 1
    assert "unexpected_errors" not in s.take_stats()
    # After a promised load, a failure while planning it reports every block failed.
    s2 = make_scheduler(model_config, ScriptedDataPlane())
    assert s2.codec is not None
    s2.get_num_new_matched_tokens(req, 0)
    s2.requests["r1"].local_tokens = BS

    def bad_hash(request, index):  # type: ignore[no-untyped-def]
        raise RuntimeError("bug")

    s2.loads.hashing = SimpleNamespace(hash_of=bad_hash, block_size=BS)  # type: ignore[assignment]
    blocks = allocation([1, 2, 3, 4])
    s2.update_state_after_alloc(req, blocks, 2 * BS)
    (batch,) = s2.build_connector_meta(_step()).loads
    assert batch.fail_all and list(batch.block_ids) == [2, 3]
    assert s2.errors == 1


def test_pins_without_a_report_are_released_after_the_bound(model_config: ModelConfig) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane())
    s.pins.report_timeout_s = 1.0
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    req = request(2 * BS + 40)
    s.get_num_new_matched_tokens(req, 0)
    s.build_connector_meta(_step(new=[("r1", ([5, 6, 7],), 0)], sched={"r1": 2 * BS + 40}))
    assert s.pinned_blocks == 2
    s.build_connector_meta(_step())
    assert s.pinned_blocks == 2  # within the bound
    for ev in s.pins.stores.values():
        ev.pinned_at -= 2.0
    s.build_connector_meta(_step())
    assert s.pinned_blocks == 0 and s.pins.stale_released == 1
    assert all(b.ref_cnt == 0 for b in pool.blocks)


def test_workers_with_other_parallel_sizes_disable_lookups(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2)
    s.adopt_handshake({(0, 0): UMBPHandshakeMetadata("abc", RankTopology(tp_rank=1, tp_size=2))})
    assert s.codec is not None and s.codec.namespace == "abc"
    s.adopt_handshake({(0, 0): UMBPHandshakeMetadata("abc", RankTopology(tp_size=1))})
    assert s.codec is None
    assert s.get_num_new_matched_tokens(request(600), 0) == (0, False)


def test_blocks_whose_load_failed_are_not_offered_again_for_a_while(
    model_config: ModelConfig,
) -> None:
    from umbp_redis.data import UMBPConnectorWorkerMetadata
    from umbp_redis.engine.quarantine import QUARANTINE_MAX_BLOCKS

    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, load_failure_quarantine_s=0.3)
    clock = [1000.0]
    s.quarantine.clock = lambda: clock[0]
    req = request(4 * BS + 5)
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    # A worker reports block 2's load failed (invalid or error reply).
    out = SimpleNamespace(
        finished_recving=None,
        kv_connector_worker_meta=UMBPConnectorWorkerMetadata({}, (req.block_hashes[2],)),
    )
    s.update_connector_output(out)  # type: ignore[arg-type]
    req2 = request(4 * BS + 5, rid="r2")
    assert s.get_num_new_matched_tokens(req2, 0) == (2 * BS, True)  # cut before block 2
    assert s.quarantine.skips == 1
    assert s.take_stats()["quarantine_skips"] == 1  # reported to vLLM's stats
    # Stored again by a worker (valid): offered at once.
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata({}, (), (req.block_hashes[2],)),
        )
    )
    assert s.get_num_new_matched_tokens(request(4 * BS + 5, rid="r2b"), 0) == (4 * BS, True)
    s.update_connector_output(out)  # type: ignore[arg-type]
    clock[0] += 0.35
    req3 = request(4 * BS + 5, rid="r3")
    assert s.get_num_new_matched_tokens(req3, 0) == (4 * BS, True)  # expired
    assert not s.quarantine
    # Bounded memory.
    many = tuple(i.to_bytes(32, "big") for i in range(QUARANTINE_MAX_BLOCKS + 10))
    s.quarantine.add(many)
    assert len(s.quarantine) == QUARANTINE_MAX_BLOCKS
    # 0 turns it off across requests; the request whose load failed is offered no more
    # hits all the same (vLLM asks it again after a failed load at the prompt's start:
    # the same value would fail forever).
    off_plane = ScriptedDataPlane()
    off = make_scheduler(model_config, off_plane, load_failure_quarantine_s=0)
    assert off.codec is not None
    off_plane.present = {off.codec.key(h, 0) for h in req.block_hashes}
    failing = request(4 * BS + 5, rid="f1")
    assert off.get_num_new_matched_tokens(failing, 0) == (4 * BS, True)
    off.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(
                {}, (failing.block_hashes[0],), (), ("f1",)
            ),
        )
    )
    assert not off.quarantine
    assert off.get_num_new_matched_tokens(failing, 0) == (0, False)
    assert off.get_num_new_matched_tokens(request(4 * BS + 5, rid="f2"), 0) == (4 * BS, True)


def test_kv_events_say_stored_once_every_worker_stored_and_removed_when_deleted(
    model_config: ModelConfig,
) -> None:
    from vllm.distributed.kv_events import BlockRemoved, BlockStored
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from umbp_redis.data import StoreEventResult, UMBPConnectorWorkerMetadata

    # Off unless vLLM's --kv-events-config enables them.
    assert make_scheduler(model_config, ScriptedDataPlane(), tp=2).events is None
    s = make_scheduler(model_config, ScriptedDataPlane(), tp=2, kv_events=True)
    assert s.num_workers == 2
    req = request(3 * BS + 40)
    req.all_token_ids = list(range(1000, 1000 + 3 * BS + 40))  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(req, 0)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([1, 2, 3, 4],), 0)], sched={"r1": 3 * BS + 40})
    )
    (batch,) = meta.stores
    eid = batch.event_id

    def report(result: StoreEventResult, **kw: Any) -> None:
        s.update_connector_output(
            SimpleNamespace(  # type: ignore[arg-type]
                finished_recving=None,
                kv_connector_worker_meta=UMBPConnectorWorkerMetadata({eid: result}, **kw),
            )
        )

    report(StoreEventResult(eid, 1))
    assert s.take_events() == []  # one rank of two: not in Redis yet
    report(StoreEventResult(eid, 1))
    events = s.take_events()
    assert [type(e) for e in events] == [BlockStored] * 3 and s.take_events() == []
    conv = [maybe_convert_block_hash(h) for h in req.block_hashes[:3]]  # type: ignore[arg-type]
    assert [e.block_hashes for e in events] == [[c] for c in conv]
    assert [e.parent_block_hash for e in events] == [None, conv[0], conv[1]]
    assert events[1].token_ids == req.all_token_ids[BS : 2 * BS]  # type: ignore[attr-defined]
    assert {e.medium for e in events} == {"REDIS"} and {e.group_idx for e in events} == {0}
    # A shared tier, with what a router needs to index the blocks as vLLM's own.
    assert {e.locality for e in events} == {"REMOTE"}
    assert {e.ownership for e in events} == {"umbp-redis"}  # an external tier to routers
    assert {e.kv_cache_spec_kind for e in events} == {"full_attention"}
    assert {e.kv_cache_spec_sliding_window for e in events} == {None}
    assert [e.extra_keys for e in events] == [[None]] * 3 and {e.block_size for e in events} == {BS}
    # A store that failed on a rank is not announced; a value deleted as invalid is.
    req2 = request(BS + 5, rid="r2")
    req2.block_hashes = [b"\x77" * 32]
    req2.all_token_ids = list(range(BS + 5))  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(req2, 0)
    meta = s.build_connector_meta(_step(new=[("r2", ([7, 8],), 0)], sched={"r2": BS + 5}))
    eid = meta.stores[0].event_id
    report(StoreEventResult(eid, 2, frozenset({"k"})), removed_blocks=(req.block_hashes[1],))
    (removed,) = s.take_events()
    # The same blocks stored again by another request soon after: announced once, except
    # the one removed meanwhile.
    again = request(3 * BS + 40, rid="r3")
    again.all_token_ids = req.all_token_ids  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(again, 0)
    meta = s.build_connector_meta(
        _step(new=[("r3", ([11, 12, 13, 14],), 0)], sched={"r3": 3 * BS + 40})
    )
    eid = meta.stores[0].event_id
    report(StoreEventResult(eid, 2))
    assert [e.block_hashes for e in s.take_events()] == [[conv[1]]]
    assert isinstance(removed, BlockRemoved) and removed.block_hashes == [conv[1]]
    assert (removed.medium, removed.locality, removed.group_idx) == ("REDIS", "REMOTE", 0)
    # A salted request's first block publishes its salt, untagged, as vLLM does.
    salted = request(2 * BS + 3, rid="salted")
    salted.block_hashes = [b"\x55" * 32, b"\x56" * 32]
    salted.all_token_ids = list(range(2 * BS + 3))  # type: ignore[attr-defined]
    salted.cache_salt = "tenant-a"
    s.get_num_new_matched_tokens(salted, 0)
    meta = s.build_connector_meta(
        _step(new=[("salted", ([21, 22, 23],), 0)], sched={"salted": 2 * BS + 3})
    )
    eid = meta.stores[0].event_id
    report(StoreEventResult(eid, 2))
    assert [e.extra_keys for e in s.take_events()] == [[("tenant-a",)], [None]]
    # Every announcement went to the namespace's stream too, for the other engines.
    from umbp_redis.data.announcements import parse_announcement

    assert s.fleet is not None
    fleet = s.fleet
    # 3 stored, 1 removed, 1 stored again, 2 salted
    wait_until(lambda: fleet.announced >= 7, 20, what="seven announcements")
    assert fleet.failures == 0
    anns = [parse_announcement(cmd[6:]) for cmd in s.plane.stream]  # type: ignore[attr-defined]
    assert [(a.stored, a.block_hash) for a in anns if a is not None] == [
        (True, h) for h in req.block_hashes[:3]
    ] + [(False, req.block_hashes[1]), (True, req.block_hashes[1])] + [
        (True, h) for h in salted.block_hashes
    ]
    assert {a.engine for a in anns if a is not None} == {s.fleet.engine_id}


def test_blocks_in_the_local_cache_or_planned_this_step_are_not_stored_twice(
    model_config: ModelConfig,
) -> None:
    s = make_scheduler(model_config, ScriptedDataPlane())
    # Every prompt block is in vLLM's local cache (no lookup needed): nothing to store.
    local = request(3 * BS + 40, rid="local")
    assert s.get_num_new_matched_tokens(local, 3 * BS) == (0, False)
    meta = s.build_connector_meta(
        _step(new=[("local", ([1, 2, 3, 4],), 3 * BS)], sched={"local": 40})
    )
    assert meta.stores == []
    # Two requests computing the same blocks in one step: each block is stored once.
    a, b = request(2 * BS + 5, rid="a"), request(2 * BS + 5, rid="b")
    for r in (a, b):
        s.get_num_new_matched_tokens(r, 0)
    meta = s.build_connector_meta(
        _step(
            new=[("a", ([5, 6, 7],), 0), ("b", ([8, 9, 10],), 0)],
            sched={"a": 2 * BS + 5, "b": 2 * BS + 5},
        )
    )
    assert [list(x.block_ids) for x in meta.stores] == [[5, 6]]


def _report_all(s: UMBPScheduler, events: list[int], workers: int = 1) -> None:
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(
                {e: StoreEventResult(e, workers) for e in events}
            ),
        )
    )


def _lazy_setup(model_config: ModelConfig, num_blocks: int, window: int, **extra: Any):  # type: ignore[no-untyped-def]
    """A lazy-mode scheduler bound to a real vLLM BlockPool, and a request whose prompt
    (3 full blocks and a partial one) ran in one step on blocks the pool allocated."""
    from vllm.v1.core.block_pool import BlockPool

    s = make_scheduler(model_config, ScriptedDataPlane(), store_mode="lazy", **extra)
    assert s.lazy is not None
    s.lazy.window = window
    pool = BlockPool(num_blocks, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool)
    req = request(3 * BS + 40)
    req.all_token_ids = list(range(3 * BS + 40))  # type: ignore[attr-defined]
    s.get_num_new_matched_tokens(req, 0)
    blocks = pool.get_new_blocks(4)
    ids = [b.block_id for b in blocks]
    meta = s.build_connector_meta(_step(new=[("r1", (ids,), 0)], sched={"r1": 3 * BS + 40}))
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)  # type: ignore[arg-type]
    return s, pool, req, blocks, meta


def test_lazy_mode_stores_blocks_only_when_vllm_is_about_to_evict_them(
    model_config: ModelConfig,
) -> None:
    s, pool, req, blocks, meta = _lazy_setup(model_config, 16, window=4)
    assert s.lazy is not None and meta.stores == []  # nothing after the forward pass
    s.request_finished(req)  # type: ignore[arg-type]
    pool.free_blocks(reversed(blocks))  # as vLLM frees a request's blocks
    # The free queue's head holds never-used blocks: nothing near eviction is cached.
    assert s.build_connector_meta(_step()).stores == []
    assert s.pinned_blocks == 0
    # Another request takes 10 blocks: the cached ones come within the window.
    taken = pool.get_new_blocks(10)
    assert all(b.block_hash is None for b in taken)  # none of r1's cached blocks reused
    meta = s.build_connector_meta(_step())
    (batch,) = meta.stores
    assert batch.request_id == "umbp-lazy-offload"
    by_block = {b.block_id: h for b, h in zip(blocks, req.block_hashes, strict=False)}
    assert sorted(batch.block_ids) == sorted(b.block_id for b in blocks[:3])
    assert [by_block[b] for b in batch.block_ids] == list(batch.block_hashes)
    assert set(batch.group_ids) == {0}
    # Pinned until stored: vLLM cannot reuse them meanwhile.
    assert s.pinned_blocks == 3 and pool.get_num_free_blocks() == 2
    assert s.build_connector_meta(_step()).stores == []  # planned once
    _report_all(s, [batch.event_id])
    assert s.pinned_blocks == 0 and pool.get_num_free_blocks() == 5
    # Still in vLLM's prefix cache after the store, and never stored again.
    assert all(b.block_hash is not None for b in blocks[:3])
    pool.get_new_blocks(3)
    assert s.build_connector_meta(_step()).stores == []
    assert s.lazy is not None and s.lazy.blocks_stored == 3


def test_lazy_mode_pins_a_finishing_requests_blocks_when_the_free_queue_is_short(
    model_config: ModelConfig,
) -> None:
    s, pool, req, blocks, meta = _lazy_setup(model_config, 8, window=16)
    assert meta.stores == [] and pool.get_num_free_blocks() == 3
    s.request_finished(req)  # type: ignore[arg-type]
    pool.free_blocks(reversed(blocks))
    # The three cached blocks stay out of the free queue until stored: a step could
    # otherwise reuse them before the next walk.
    assert pool.get_num_free_blocks() == 4 and s.pinned_blocks == 3
    assert s.has_pending_block_frees()
    meta = s.build_connector_meta(_step())
    (batch,) = meta.stores
    assert list(batch.block_hashes) == req.block_hashes[:3]
    assert list(batch.block_ids) == [b.block_id for b in blocks[:3]]
    _report_all(s, [batch.event_id])
    assert s.pinned_blocks == 0 and pool.get_num_free_blocks() == 7
    assert s.build_connector_meta(_step()).stores == []


def test_lazy_mode_skips_redis_hits_and_announces_what_it_stored(
    model_config: ModelConfig,
) -> None:
    from vllm.v1.core.block_pool import BlockPool

    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, store_mode="lazy", kv_events=True)
    assert s.lazy is not None
    s.lazy.window = 64
    pool = BlockPool(8, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool)
    req = request(3 * BS + 40)
    req.all_token_ids = list(range(3 * BS + 40))  # type: ignore[attr-defined]
    assert s.codec is not None
    plane.present = {s.codec.key(req.block_hashes[0], 0)}  # block 0 is in Redis
    assert s.get_num_new_matched_tokens(req, 0) == (BS, True)
    blocks = pool.get_new_blocks(4)
    ids = [b.block_id for b in blocks]
    s.build_connector_meta(_step(new=[("r1", (ids,), BS)], sched={"r1": 2 * BS + 40}))
    pool.cache_full_blocks(req, blocks, 0, 3, BS, 0)  # type: ignore[arg-type]
    s.request_finished(req)  # type: ignore[arg-type]
    pool.free_blocks(reversed(blocks))
    (batch,) = s.build_connector_meta(_step()).stores
    assert list(batch.block_hashes) == req.block_hashes[1:3]  # not the Redis hit
    _report_all(s, [batch.event_id])
    events = s.take_events()
    assert (
        [e.token_ids for e in events]
        == [
            req.all_token_ids[BS : 2 * BS],  # type: ignore[attr-defined]
            req.all_token_ids[2 * BS : 3 * BS],  # type: ignore[attr-defined]
        ]
    )
    assert {e.medium for e in events} == {"REDIS"}


def test_eager_mode_is_the_default_and_store_mode_is_checked(model_config: ModelConfig) -> None:
    from umbp_redis.store.errors import ConfigError

    assert EngineOptions().store_mode == "eager"
    with pytest.raises(ConfigError, match="store_mode"):
        parse_connector_options({"store_mode": "later"})


def _hybrid_scheduler(
    model_config: ModelConfig, plane: ScriptedDataPlane, **extra: Any
) -> UMBPScheduler:
    """Group 0: sliding window of 2 * BS + 1 tokens (a hit needs the 2 blocks before
    it); group 1: full attention. A real vLLM KVCacheConfig of two groups."""
    import torch
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        SlidingWindowSpec,
    )

    kw: dict[str, Any] = {
        "block_size": BS,
        "num_kv_heads": 2,
        "head_size": 64,
        "dtype": torch.bfloat16,
    }
    kv = KVCacheConfig(
        num_blocks=64,
        kv_cache_tensors=[],
        kv_cache_groups=[
            KVCacheGroupSpec(["l0"], SlidingWindowSpec(**kw, sliding_window=2 * BS + 1)),
            KVCacheGroupSpec(["l1"], FullAttentionSpec(**kw)),
        ],
    )
    cfg = make_vllm_config(model_config, extra={"key_namespace": "unit", **extra})
    options = parse_connector_options(ktc(cfg).kv_connector_extra_config)
    s = UMBPScheduler(cfg, kv, *options, plane=plane)  # type: ignore[arg-type]
    plane.codec = s.codec
    return s


def test_hybrid_hit_needs_every_full_block_and_the_window_before_it(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = _hybrid_scheduler(model_config, plane)
    assert s.codec is not None and s.groups == [0, 1]
    req = request(8 * BS + 10)
    full = [s.codec.key(h, 1) for h in req.block_hashes]
    window = [s.codec.key(h, 0) for h in req.block_hashes]
    # Full attention holds blocks 0..7; the sliding window only blocks 2, 3 and 6:
    # boundaries 4 (needs window blocks 2, 3) and none above (7 needs 5, 6).
    plane.present = set(full) | {window[2], window[3], window[6]}
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BS, True)
    # One round trip asks every block of both groups.
    assert sorted(plane.calls[-1]) == sorted(
        marker_keys(s, req.block_hashes[:8], 1) + marker_keys(s, req.block_hashes[:8], 0)
    )
    plane.present.add(window[5])
    assert s.get_num_new_matched_tokens(req, 0) == (7 * BS, True)
    # Beyond a local hit of 5 blocks only the window blocks from block 5 on count.
    plane.present -= {window[2], window[3]}
    assert s.get_num_new_matched_tokens(req, 5 * BS) == (2 * BS, True)
    # The load: full attention every block of the hit, the window only its 2 blocks,
    # and never vLLM's null block (a sliding window's blocks before the window).
    null = SimpleNamespace(is_null=True)
    real = SimpleNamespace(is_null=False)
    ids = ([0] * 5 + [15, 16], [10, 11, 12, 13, 14, 20, 21])
    blocks = SimpleNamespace(
        get_block_ids=lambda: ids,
        blocks=([null] * 5 + [real, real], [real] * 7),
    )
    s.update_state_after_alloc(req, blocks, 2 * BS)  # type: ignore[arg-type]
    (batch,) = s.loads.pending
    assert sorted(zip(batch.group_ids, batch.block_ids, strict=True)) == [
        (0, 15),
        (0, 16),
        (1, 20),
        (1, 21),
    ]
    assert set(batch.block_hashes) == {req.block_hashes[5], req.block_hashes[6]}


def _stored_blocks(meta: Any) -> list[tuple[int, int]]:
    """(group, engine block id) of every block a step's metadata stores, sorted."""
    return sorted(
        (g, b)
        for batch in meta.stores
        for g, b in zip(batch.group_ids, batch.block_ids, strict=True)
    )


@pytest.mark.parametrize(
    ("prompt_blocks", "local_blocks", "window_ids", "stored_window"),
    [
        # Redis holds a 3-block prefix another prompt stored (full attention only: this
        # prompt leaves it at block 3) and nothing of the sliding window. Full
        # attention: every complete block (present in full attention only is not a
        # hit: all are computed and stored). Sliding window: the 2 blocks before the
        # prompt's end (block 8) and before where it left Redis's prefix (block 3).
        (8, 0, list(range(100, 109)), [101, 102, 106, 107]),
        # As above, but vLLM's local cache holds those 3 blocks: the window before
        # block 3 is sent from the engine's local blocks (block 0 is outside the window
        # there: vLLM's null block).
        (6, 3, [0, 101, 102, 103, 104, 105, 106], [101, 102, 104, 105]),
    ],
)
def test_hybrid_stores_full_blocks_and_the_window_before_hit_points(
    model_config: ModelConfig,
    prompt_blocks: int,
    local_blocks: int,
    window_ids: list[int],
    stored_window: list[int],
) -> None:
    plane = ScriptedDataPlane()
    s = _hybrid_scheduler(model_config, plane)
    assert s.codec is not None
    n_tokens = prompt_blocks * BS + 10
    req = request(n_tokens)
    plane.present = {s.codec.key(h, 1) for h in req.block_hashes[:3]}
    assert s.get_num_new_matched_tokens(req, local_blocks * BS) == (0, False)
    full_ids = list(range(200, 200 + prompt_blocks + 1))
    meta = s.build_connector_meta(
        _step(
            new=[("r1", (window_ids, full_ids), local_blocks * BS)],
            sched={"r1": n_tokens - local_blocks * BS},
        )
    )
    stored = _stored_blocks(meta)
    assert [b for g, b in stored if g == 1] == full_ids[local_blocks:prompt_blocks]
    assert [b for g, b in stored if g == 0] == stored_window


def test_idle_steps_wait_briefly_only_while_loads_are_in_flight(
    model_config: ModelConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    from umbp_redis.engine import scheduler as sched_mod

    slept: list[float] = []
    monkeypatch.setattr(sched_mod.time, "sleep", slept.append)
    for wait_ms in (1.0, 0):
        slept.clear()
        plane = ScriptedDataPlane()
        s = make_scheduler(model_config, plane)
        assert s.idle_wait_s == sched_mod.IDLE_WAIT_S == 0.001
        s.idle_wait_s = wait_ms / 1e3  # 0: no wait
        pool = FakeBlockPool(32)
        s.bind_block_pool(pool)
        req = request(3 * BS + 40)
        assert s.codec is not None
        plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
        assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)
        ids = allocation([1, 2, 3, 4])
        s.update_state_after_alloc(req, ids, 3 * BS)  # type: ignore[arg-type]

        def idle(tokens: int) -> Any:
            out = _step(sched={})
            out.total_num_scheduled_tokens = tokens
            return out

        s.build_connector_meta(idle(0))  # the step that sends the load: no wait
        s.build_connector_meta(idle(0))  # waiting for it, nothing else to do: wait
        s.build_connector_meta(idle(5))  # other requests computing: no wait
        s.update_connector_output(
            SimpleNamespace(finished_recving={"r1"}, kv_connector_worker_meta=None)  # type: ignore[arg-type]
        )
        s.build_connector_meta(idle(0))  # the load is done: no wait
        assert slept == ([0.001] if wait_ms else [])
        assert s.idle_waits == len(slept)


def test_lazy_mode_on_a_hybrid_model_stores_each_groups_blocks_on_eviction(
    model_config: ModelConfig,
) -> None:
    """Lazy stores follow each group's plan: every full-attention block, the sliding
    window's blocks before the prompt's end only, taken from vLLM's free queue (one
    BlockPool shared by both groups) when they come within reach of eviction."""
    from vllm.v1.core.block_pool import BlockPool

    s = _hybrid_scheduler(model_config, ScriptedDataPlane(), store_mode="lazy")
    assert s.lazy is not None
    s.lazy.window = 4
    pool = BlockPool(32, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool)
    req = request(6 * BS + 10)
    s.get_num_new_matched_tokens(req, 0)
    window_blocks = pool.get_new_blocks(7)
    full_blocks = pool.get_new_blocks(7)
    ids = ([b.block_id for b in window_blocks], [b.block_id for b in full_blocks])
    meta = s.build_connector_meta(_step(new=[("r1", ids, 0)], sched={"r1": 6 * BS + 10}))
    assert meta.stores == []
    pool.cache_full_blocks(req, window_blocks, 0, 6, BS, 0)  # type: ignore[arg-type]
    pool.cache_full_blocks(req, full_blocks, 0, 6, BS, 1)  # type: ignore[arg-type]
    s.request_finished(req)  # type: ignore[arg-type]
    pool.free_blocks(reversed(full_blocks))
    pool.free_blocks(reversed(window_blocks))
    assert s.build_connector_meta(_step()).stores == []  # never-used blocks ahead
    pool.get_new_blocks(pool.get_num_free_blocks() - 14)  # the request's blocks come next
    (batch,) = s.build_connector_meta(_step()).stores
    stored = sorted(zip(batch.group_ids, batch.block_ids, strict=True))
    assert [b for g, b in stored if g == 1] == sorted(b.block_id for b in full_blocks[:6])
    # The window reaches 2 blocks back from the prompt's end (block 6): blocks 4 and 5.
    assert [b for g, b in stored if g == 0] == sorted(b.block_id for b in window_blocks[4:6])


def test_auto_load_mode_loads_small_hits_before_the_step_and_large_ones_async(
    model_config: ModelConfig,
) -> None:
    # One block of the test layout: K and V of BS tokens, 2 heads of 64, bf16, per layer.
    block_bytes = 2 * BS * 2 * 64 * 2 * len(LAYERS)
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, load_async="auto", sync_load_max_bytes=2 * block_bytes)
    assert s.load_policy.bytes_per_block == block_bytes
    req = request(6 * BS + 10)
    assert s.codec is not None
    keys = [s.codec.key(h, 0) for h in req.block_hashes]
    plane.present = set(keys[:2])
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, False)  # 2 blocks: sync
    plane.present = set(keys[:3])
    assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)  # 3 blocks: async
    # Beyond a local hit only the blocks to load count.
    assert s.get_num_new_matched_tokens(req, BS) == (2 * BS, False)
    # The load carries the mode vLLM was told; a sync one pins no blocks.
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    ids = allocation([1, 2, 3, 4, 5, 6])
    s.update_state_after_alloc(req, ids, 2 * BS)  # type: ignore[arg-type]
    (batch,) = s.build_connector_meta(_step(sched={})).loads
    assert batch.load_async is False and batch.block_ids == (2, 3)
    assert not s.pins.loads
    # Set explicitly, load_async holds for every size.
    for mode in (True, False):
        fixed_plane = ScriptedDataPlane()
        fixed = make_scheduler(model_config, fixed_plane, load_async=mode)
        assert fixed.codec is not None
        fixed_plane.present = {fixed.codec.key(h, 0) for h in req.block_hashes}
        assert fixed.get_num_new_matched_tokens(req, 0) == (6 * BS, mode)
    with pytest.raises(ConfigError, match="load_async"):
        make_scheduler(model_config, ScriptedDataPlane(), load_async="sometimes")


def test_auto_load_mode_loads_larger_hits_in_the_step_where_every_worker_loads_by_layer(
    model_config: ModelConfig,
) -> None:
    block_bytes = 2 * BS * 2 * 64 * 2 * len(LAYERS)
    plane = ScriptedDataPlane()
    s = make_scheduler(
        model_config,
        plane,
        load_async="auto",
        sync_load_max_bytes=block_bytes,
    )
    s.load_policy.layer_load_max_bytes = 4 * block_bytes
    req = request(6 * BS + 10)
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
    ns = s.codec.namespace
    by_layer = UMBPHandshakeMetadata(ns, RankTopology(), loads_by_layer=True)
    whole = UMBPHandshakeMetadata(ns, RankTopology(), loads_by_layer=False)
    assert s.get_num_new_matched_tokens(req, 0) == (6 * BS, True)  # before any handshake
    s.adopt_handshake({(0, 0): by_layer, (1, 0): whole})  # not every worker: as before
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (4 * BS, True)
    s.adopt_handshake({(0, 0): by_layer, (1, 0): by_layer})
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (4 * BS, False)  # 4 blocks: by layer
    assert s.get_num_new_matched_tokens(req, BS) == (5 * BS, True)  # 5: over the limit
    # A worker that turned loads by layer off (its forward pass skipped a layer's wait):
    # large hits load async again.
    off = UMBPConnectorWorkerMetadata(layer_loads_off=True)
    s.update_connector_output(
        SimpleNamespace(finished_recving=None, kv_connector_worker_meta=off)  # type: ignore[arg-type]
    )
    assert s.get_num_new_matched_tokens(req, 2 * BS) == (4 * BS, True)


def test_a_hybrid_model_always_loads_async(model_config: ModelConfig) -> None:
    """vLLM takes failed sync loads only as block ids, which it cannot map to requests
    with several cache groups: every load of such a model is async."""
    for mode in ("auto", False):
        plane = ScriptedDataPlane()
        s = _hybrid_scheduler(model_config, plane, load_async=mode, sync_load_max_bytes=1 << 40)
        assert s.codec is not None
        req = request(3 * BS + 10)
        plane.present = {s.codec.key(h, g) for h in req.block_hashes for g in (0, 1)}
        assert s.get_num_new_matched_tokens(req, 0) == (3 * BS, True)


def _a_sync_load_on_a_real_block_pool(
    model_config: ModelConfig,
) -> tuple[UMBPScheduler, FakeRequest, list[Any], UMBPConnectorMetadata]:
    """A scheduler over vLLM's BlockPool and a request of 5 full blocks, no output yet:
    block 0 is in vLLM's local cache, blocks 1 and 2 load sync, 3 and 4 are computed;
    its step planned. Returns (scheduler, request, its 6 blocks, the step's metadata)."""
    from vllm.v1.core.block_pool import BlockPool

    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, load_async="auto")
    pool = BlockPool(16, enable_caching=True, hash_block_size=BS)
    s.bind_block_pool(pool)
    req = request(5 * BS + 40)
    req.all_token_ids = list(range(5 * BS + 40))  # type: ignore[attr-defined]
    req.num_output_tokens = 0
    assert s.codec is not None
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes[:3]}
    assert s.get_num_new_matched_tokens(req, BS) == (2 * BS, False)
    blocks = pool.get_new_blocks(6)
    ids = [b.block_id for b in blocks]
    s.update_state_after_alloc(req, KVCacheBlocks((blocks,)), 2 * BS)
    pool.cache_full_blocks(req, blocks, 0, 5, BS, 0)  # type: ignore[arg-type]
    meta = s.build_connector_meta(_step(new=[("r1", (ids,), 3 * BS)], sched={"r1": 2 * BS + 40}))
    return s, req, blocks, meta


def test_a_failed_sync_load_takes_its_blocks_out_of_vllms_prefix_cache(
    model_config: ModelConfig,
) -> None:
    """vLLM caches a sync load's blocks, and those the step computes after them, before
    the load runs; when a worker reports the load failed, the scheduler evicts them from
    vLLM's prefix cache (a real BlockPool), the blocks before the load stay."""
    s, req, blocks, meta = _a_sync_load_on_a_real_block_pool(model_config)
    ids = [b.block_id for b in blocks]
    (load,) = meta.loads
    assert load.load_async is False and load.block_ids == tuple(ids[1:3])
    assert all(b.block_hash is not None for b in blocks[:5])
    # A report without a failed sync load changes nothing.
    s.update_connector_output(
        SimpleNamespace(
            finished_recving=None, kv_connector_worker_meta=UMBPConnectorWorkerMetadata()
        )  # type: ignore[arg-type]
    )
    assert all(b.block_hash is not None for b in blocks[:5])
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(sync_failed_requests=("r1",)),
        )
    )
    assert blocks[0].block_hash is not None  # before the load: vLLM's own, still a hit
    assert all(b.block_hash is None for b in blocks[1:5])  # loaded, or computed on them
    assert s.loads.uncached_blocks == 5  # the request's blocks from the load on


@pytest.mark.parametrize("outputs_after_load", [0, 1])
def test_a_request_ended_before_its_sync_load_was_confirmed_leaves_no_cached_block(
    model_config: ModelConfig, outputs_after_load: int
) -> None:
    """A request aborted after the step of its sync load but before vLLM applied that
    step's output (async scheduling) has output no token since: its loaded blocks may
    hold bytes that are not their KV, and nothing will report the failure (the request
    is gone), so they leave vLLM's prefix cache when it ends. One that output a token
    since had its load confirmed: its blocks stay cached."""
    s, req, blocks, meta = _a_sync_load_on_a_real_block_pool(model_config)
    assert meta.loads[0].load_async is False
    req.num_output_tokens = outputs_after_load
    s.request_finished(req)  # type: ignore[arg-type]
    assert blocks[0].block_hash is not None  # before the load: vLLM's own
    if outputs_after_load:
        assert all(b.block_hash is not None for b in blocks[1:5])
        assert s.loads.uncached_blocks == 0
        assert len(s.quarantine) == 0
    else:
        assert all(b.block_hash is None for b in blocks[1:5])
        assert s.loads.uncached_blocks == 5
        # Its loaded blocks are not offered from Redis either until the quarantine ends
        # (their markers may outlive values a failed load deleted).
        assert len(s.quarantine) == 2
        again = request(5 * BS + 40, rid="r2")
        assert s.get_num_new_matched_tokens(again, BS) == (0, False)


def test_with_an_admission_rule_a_block_is_stored_once_enough_requests_asked_for_it(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, load_async=False, store_after_requests=2)
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    assert s.codec is not None
    first = request(3 * BS + 40)
    # The first lookup counts the request against each of its 3 prompt blocks, in the
    # same round trip as the lookup itself: asked once, none is admitted.
    assert s.get_num_new_matched_tokens(first, 0) == (0, False)
    assert len(plane.calls) == 1
    counters = [s.codec.request_count_prefix + h.hex() for h in first.block_hashes]
    assert plane.asked == dict.fromkeys(counters, 1)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([5, 6, 7, 8],), 0)], sched={"r1": 3 * BS + 40})
    )
    assert meta.stores == []
    # Asked again (same lookup state): not counted twice.
    s.get_num_new_matched_tokens(first, 0)
    assert plane.asked == dict.fromkeys(counters, 1)
    # A second request shares the first two blocks, which this engine holds locally but
    # Redis lacks: now asked twice, they are stored; its own third block is not.
    second = FakeRequest("r2", 3 * BS + 40, [*first.block_hashes[:2], b"\x99" * 32])
    assert s.get_num_new_matched_tokens(second, 2 * BS) == (0, False)
    meta = s.build_connector_meta(
        _step(new=[("r2", ([5, 6, 9, 10],), 2 * BS)], sched={"r2": BS + 40})
    )
    assert [(list(b.block_ids), list(b.block_hashes)) for b in meta.stores] == [
        ([5, 6], first.block_hashes[:2])
    ]
    # Once Redis holds them, a third request finds them there and stores nothing again.
    plane.present = {s.codec.key(h, 0) for h in first.block_hashes[:2]}
    third = FakeRequest("r3", 3 * BS + 40, [*first.block_hashes[:2], b"\x98" * 32])
    assert s.get_num_new_matched_tokens(third, 2 * BS) == (0, False)
    meta = s.build_connector_meta(
        _step(new=[("r3", ([5, 6, 11, 12],), 2 * BS)], sched={"r3": BS + 40})
    )
    assert meta.stores == []
    assert plane.asked[counters[0]] == 3


def test_a_request_whose_counting_lookup_failed_stores_nothing(model_config: ModelConfig) -> None:
    plane = ScriptedDataPlane(fail=True)
    s = make_scheduler(model_config, plane, load_async=False, store_after_requests=2)
    s.bind_block_pool(FakeBlockPool(32))
    req = request(3 * BS + 40)
    assert s.get_num_new_matched_tokens(req, 0) == (0, False)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([5, 6, 7, 8],), 0)], sched={"r1": 3 * BS + 40})
    )
    assert meta.stores == []


def test_the_admission_rule_needs_lookups(model_config: ModelConfig) -> None:
    with pytest.raises(ConfigError, match=r"store_after_requests.*kv_both"):
        make_scheduler(
            model_config, ScriptedDataPlane(), role="kv_producer", store_after_requests=2
        )
    with pytest.raises(ConfigError, match="store_after_requests"):
        parse_connector_options({"store_after_requests": 0})
    # Without the rule nothing is counted.
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    s.get_num_new_matched_tokens(request(3 * BS + 40), 0)
    assert plane.asked == {}


def _report(s: UMBPScheduler, results: dict[int, StoreEventResult], **meta: Any) -> None:
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(results, **meta),
        )
    )


def test_the_namespace_record_is_published_from_the_marker_thread_once_a_minute(
    model_config: ModelConfig,
) -> None:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import init_none_hash

    from umbp_redis.data.lookup_record import NamespaceRecord
    from umbp_redis.engine import namespace_advert
    from umbp_redis.store.settings import OPTIONS_BY_NAME

    init_none_hash(sha256)  # as vLLM's engine core does before the first step
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    now = [1000.0]
    s.advert.clock = lambda: now[0]
    s.build_connector_meta(_step())
    assert s.markers.flush(5)
    (blob,) = plane.records.values()
    rec = NamespaceRecord.from_json(blob)
    assert rec.namespace == "unit" and rec.serves(str(model_config.model))
    assert (rec.block_size, rec.hash_algo, rec.reproducible) == (BS, "sha256", True)
    assert [g.kind for g in rec.groups] == ["full_attention"]
    sets = [c for c in plane.keyed if c[0] == b"SET" and c[1].endswith(b":model")]
    ttl = str(OPTIONS_BY_NAME["ttl_seconds"].default).encode()
    assert len(sets) == 1 and sets[0][3:] == [b"EX", ttl]
    s.build_connector_meta(_step())  # within the minute: not again
    now[0] += namespace_advert.REFRESH_S
    s.build_connector_meta(_step())
    assert s.markers.flush(5)
    assert len([c for c in plane.keyed if c[0] == b"SET" and c[1].endswith(b":model")]) == 2
    # A consumer stores nothing, its record included.
    consumer_plane = ScriptedDataPlane()
    c = make_scheduler(model_config, consumer_plane, role="kv_consumer")
    c.build_connector_meta(_step())
    assert c.markers.flush(5) and consumer_plane.records == {}


def test_a_block_is_marked_stored_once_every_rank_reported_it_and_none_failed(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2)
    pool = FakeBlockPool(32)
    s.bind_block_pool(pool)
    req = request(3 * BS + 40)
    s.get_num_new_matched_tokens(req, 0)
    meta = s.build_connector_meta(
        _step(new=[("r1", ([5, 6, 7, 8],), 0)], sched={"r1": 3 * BS + 40})
    )
    (batch,) = meta.stores
    assert list(batch.block_hashes) == req.block_hashes[:3]
    # vLLM keeps stepping while the stores await their reports (no request left).
    assert s.has_pending_push_work()
    eid = batch.event_id
    assert s.codec is not None
    failed = s.codec.key(req.block_hashes[1], 0, RankTopology(tp_size=2, tp_rank=1))
    _report(s, {eid: StoreEventResult(eid)})  # tp0 done
    assert s.markers.flush(5) and plane.markers == set()  # tp1 has not reported yet
    _report(s, {eid: StoreEventResult(eid, 1, frozenset({failed}))})  # tp1: block 1 failed
    assert s.markers.flush(5)
    assert sorted(plane.markers) == sorted(marker_keys(s, [req.block_hashes[i] for i in (0, 2)]))
    assert not s.has_pending_push_work()
    stats = s.take_stats()
    assert stats["markers_written"] == 2
    # A lookup reads the markers alone: block 0 hits, block 1 (unmarked) ends the hit.
    s.markers.refresh_interval_s = 0.0  # values just stored need no refresh: pass time
    other = request(3 * BS + 40, rid="r2")
    assert s.get_num_new_matched_tokens(other, 0) == (BS, True)
    # The found prefix's values are refreshed, every rank's key, on the writer's thread
    # (block 2, past the gap, is of no use to this request: not refreshed).
    assert s.markers.flush(5)
    refreshed = [c for c in plane.keyed if c[0] == b"EXPIRE"]
    assert sorted(c[1].decode() for c in refreshed) == sorted(
        s.codec.rank_keys(req.block_hashes[0], 0)
    )
    # The values were not in the scripted Redis: the refresh found them gone and
    # deleted the marker, so the next lookup misses instead of failing a load.
    assert plane.markers == {marker_keys(s, [req.block_hashes[2]])[0]}
    assert s.get_num_new_matched_tokens(request(3 * BS + 40, rid="r3"), 0) == (0, False)
    assert s.take_stats()["stale_markers_removed"] == 1


def test_found_values_are_refreshed_at_most_once_an_interval_and_invalid_ones_unmarked(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, tp=2)
    assert s.markers.refresh_interval_s == 1.0  # Redis' LRU clock counts seconds
    s.markers.refresh_interval_s = 3600.0  # no test step takes that long
    req = request(2 * BS + 40)
    assert s.codec is not None
    plane.present = {k for h in req.block_hashes for k in s.codec.rank_keys(h, 0)}
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert s.markers.flush(5)
    assert len([c for c in plane.keyed if c[0] == b"EXPIRE"]) == 2 * 2  # 2 blocks x 2 ranks
    assert s.get_num_new_matched_tokens(request(2 * BS + 40, rid="r2"), 0) == (2 * BS, True)
    assert s.markers.flush(5)
    assert len(plane.keyed) == 4  # within the interval: not again
    assert s.take_stats()["values_refreshed"] == 4
    # A worker found block 0's value invalid and deleted it: its marker goes too.
    plane.markers = set(marker_keys(s, req.block_hashes[:2]))
    _report(s, {}, removed_blocks=(req.block_hashes[0],))
    assert s.markers.flush(5)
    assert plane.markers == set(marker_keys(s, req.block_hashes[1:2]))


def test_a_marker_written_after_its_value_was_found_gone_is_kept(
    model_config: ModelConfig,
) -> None:
    """A refresh finds a value gone; before its marker's deletion goes out, the engine
    stored the block again and marked it: the new marker is right and stays. A block
    found gone after its last marker loses the marker."""
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane)
    assert s.codec is not None
    h = bytes([7]) * 32
    (marker,) = marker_keys(s, [h])
    found_gone = s.markers._unmark({(h, 0): s.codec})  # the refresh's answer, now
    s.markers.track(1, [h], [0])
    s.markers.note_store_report(s.codec, 1, 1, frozenset())  # stored again, marked
    assert s.markers.flush(5) and plane.markers == {marker}
    s.markers._enqueue(found_gone)
    assert s.markers.flush(5) and plane.markers == {marker}
    s.markers._enqueue(s.markers._unmark({(h, 0): s.codec}))  # gone after the marker
    assert s.markers.flush(5) and plane.markers == set()


def test_a_refresh_with_an_unknown_answer_keeps_the_marker(model_config: ModelConfig) -> None:
    """A refresh answered by an error reply or a failed node (-1) proves nothing gone."""

    class Unknowing(ScriptedDataPlane):
        def run_keyed(self, commands: list[tuple[bytes, bytes]], *, timeout: float) -> list[int]:
            out = super().run_keyed(commands, timeout=timeout) or []
            return [
                -1 if c[1].startswith(b"*3\r\n$6\r\nEXPIRE") else r
                for c, r in zip(commands, out, strict=True)
            ]

    plane = Unknowing()
    s = make_scheduler(model_config, plane)
    s.markers.refresh_interval_s = 0.0
    req = request(2 * BS + 40)
    plane.markers = set(marker_keys(s, req.block_hashes[:2]))
    assert s.get_num_new_matched_tokens(req, 0) == (2 * BS, True)
    assert s.markers.flush(5)
    assert plane.markers == set(marker_keys(s, req.block_hashes[:2]))
    stats = s.take_stats()
    assert stats["marker_failures"] == 2 and stats.get("stale_markers_removed", 0) == 0


def _teach_rates(
    s: UMBPScheduler, clock: list[float], *, load_s_per_block: float, s_per_token: float
) -> None:
    """Workers report loads at ``load_s_per_block``; steps of the engine compute at
    ``s_per_token`` (through the hooks vLLM calls, on a scripted clock)."""
    from umbp_redis.data import UMBPConnectorWorkerMetadata

    per_block = s.load_policy.bytes_per_block
    times = tuple((n * per_block, 0.001 + n * load_s_per_block, True) for n in (1, 2, 4, 8))
    s.update_connector_output(
        SimpleNamespace(  # type: ignore[arg-type]
            finished_recving=None,
            kv_connector_worker_meta=UMBPConnectorWorkerMetadata(load_times=times),
        )
    )
    for tokens in (64, 256, 512, 1024, 2048, 128, 768, 1536, 4096, 32):
        step = _step()
        step.total_num_scheduled_tokens = tokens
        s.build_connector_meta(step)
        clock[0] += 0.002 + tokens * s_per_token
        s.update_connector_output(
            SimpleNamespace(finished_recving=None, kv_connector_worker_meta=None)  # type: ignore[arg-type]
        )


def test_hits_that_load_slower_than_they_compute_are_declined(
    model_config: ModelConfig,
) -> None:
    plane = ScriptedDataPlane()
    s = make_scheduler(model_config, plane, load_async="auto")  # small hits: sync
    clock = [50.0]
    s.benefit.clock = lambda: clock[0]
    assert s.codec is not None
    req = request(6 * BS + 5)
    plane.present = {s.codec.key(h, 0) for h in req.block_hashes}
    # Nothing learned yet: the hit loads.
    assert s.get_num_new_matched_tokens(req, 0) == (6 * BS, False)
    # A block loads in 50 ms; the engine computes a block's tokens in 1.3 ms.
    _teach_rates(s, clock, load_s_per_block=0.05, s_per_token=1e-5)
    slow = request(6 * BS + 5, rid="slow")
    assert s.get_num_new_matched_tokens(slow, 0) == (0, False)
    assert s.get_num_new_matched_tokens(slow, 0) == (0, False)  # asked again: counted once
    # Its blocks are in Redis: computing them here does not store them again.
    assert s.requests["slow"].known_stored_blocks == 6
    stats = s.take_stats()
    assert stats["loads_declined"] == 1 and stats["tokens_declined"] == 6 * BS
    # A probe interval later, one block of the next hit loads (async) to measure the link.
    clock[0] += s.benefit.probe_interval_s + 1
    assert s.get_num_new_matched_tokens(request(6 * BS + 5, rid="p"), 0) == (BS, True)
    assert s.take_stats()["load_probes"] == 1
    # Beyond a local prefix hit, the same comparison for what is left.
    assert s.get_num_new_matched_tokens(request(6 * BS + 5, rid="l"), 2 * BS) == (0, False)
    # The link is fast: hits load again (a load far faster than expected restarts the line).
    _teach_rates(s, clock, load_s_per_block=1e-4, s_per_token=1e-5)
    assert s.get_num_new_matched_tokens(request(6 * BS + 5, rid="fast"), 0) == (6 * BS, False)
    # Turned off, every hit loads.
    off_plane = ScriptedDataPlane()
    off = make_scheduler(model_config, off_plane, decline_slow_loads=False, load_async="auto")
    off.benefit.clock = lambda: clock[0]
    assert off.codec is not None
    off_plane.present = {off.codec.key(h, 0) for h in req.block_hashes}
    _teach_rates(off, clock, load_s_per_block=0.05, s_per_token=1e-5)
    # (async: expected to take 0.3 s, over half of sync_load_timeout_s)
    assert off.get_num_new_matched_tokens(request(6 * BS + 5, rid="o"), 0) == (6 * BS, True)
    assert "loads_declined" not in off.take_stats()
