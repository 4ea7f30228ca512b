"""The fleet's block announcements: the stream format (no Redis), the feed against a
real server (relays, removals, late engines, bounds, malformed entries, Redis away) and
the KV events that carry them."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import redis
from helpers import check_fleet_feed, wait_for_events
from waiting import wait_until

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.data.announcements import Announcement, announcement_key, parse_announcement
from umbp_redis.engine import fleet_blocks
from umbp_redis.engine.fleet_blocks import FleetBlockFeed
from umbp_redis.engine.kv_events import EventBlock, GroupSpecInfo, StoredBlockEvents
from umbp_redis.store.plane import RedisDataPlane
from umbp_redis.store.settings import RedisSettings

CODEC = BlockIdentityCodec("fleet")
SPECS = {0: GroupSpecInfo("full_attention", None)}


def make_feed(plane: RedisDataPlane, engine: str, **kw) -> FleetBlockFeed:  # type: ignore[no-untyped-def]
    opts: dict[str, Any] = dict(poll_interval_s=0.01, verify_interval_s=0.05, verify_grace_s=0.0)
    opts.update(kw)
    f = FleetBlockFeed(plane, CODEC, engine, 4, SPECS, ttl_s=100, timeout_s=2.0, **opts)
    f.start()
    return f


def block(i: int, group: int = 0) -> EventBlock:
    return EventBlock(bytes([i % 256, i // 256]) * 16, None, (i, i + 1, i + 2, i + 3), group)


def test_an_announcement_reads_back_as_written_and_malformed_entries_are_refused() -> None:
    ann = Announcement(
        True, "e1", b"h" * 32, 1, b"p" * 32, (0, 7, 2**31), (("mm", 3), "salt"), 2, "lora-x"
    )
    assert parse_announcement(ann.fields()) == ann
    gone = Announcement(False, "e1", b"h" * 32, 0)
    assert parse_announcement(gone.fields()) == gone
    good = ann.fields()
    assert parse_announcement(good[:-1]) is None  # odd field count
    for name, value in [
        (b"o", b"x"),
        (b"g", b"-1"),
        (b"g", b"one"),
        (b"t", b"abc"),
        (b"m", b"[1]"),
        (b"m", b"{bad"),
        (b"h", b""),
    ]:
        broken = list(good)
        broken[broken.index(name) + 1] = value
        assert parse_announcement(broken) is None, (name, value)
    assert parse_announcement([b"o", b"s", b"e", b"x"]) is None  # fields missing
    # Pins the stream's key: the one place the schema is spelled out by hand here.
    assert announcement_key("ns1") == "umbp:vllm:v2:ns1:announced"


def test_engines_see_each_others_blocks_as_an_external_tier(redis_url: str) -> None:
    plane = RedisDataPlane(RedisSettings.from_url(redis_url))
    client = redis.Redis.from_url(redis_url)
    check_fleet_feed(plane, client)
    # The stream expires with the values' TTL.
    assert 0 < client.ttl(announcement_key("fleet")) <= 100
    plane.close()


def test_the_stream_and_the_credits_stay_bounded(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(fleet_blocks, "MAX_STREAM_ENTRIES", 100)
    monkeypatch.setattr(fleet_blocks, "MAX_CREDITED", 50)
    monkeypatch.setattr(fleet_blocks, "TAKE_MAX", 3)
    plane = RedisDataPlane(RedisSettings.from_url(redis_url))
    client = redis.Redis.from_url(redis_url)
    a = make_feed(plane, "a")
    blocks = [block(i) for i in range(1000)]
    for b in blocks:
        client.set(CODEC.marker_key(b.block_hash, 0), b"1", ex=100)
    a.announce_stored(blocks)
    wait_until(lambda: a.announced >= 1000, 20, what=lambda: f"{a.announced} announced")
    assert a.failures == 0
    # XADD MAXLEN ~ trims whole stream nodes: about the bound, never the whole history.
    assert client.xlen(announcement_key("fleet")) < 300
    # A's own credits beyond the bound were announced removed (the oldest first).
    removed = a.take()
    assert sum(len(e.block_hashes) for e in removed) == 950 and a.removed == 950
    assert a.credits((blocks[-1].block_hash, 0)) and not a.credits((blocks[0].block_hash, 0))
    # A late engine credits at most the bound, too.
    late = make_feed(plane, "b")
    wait_until(lambda: late.caught_up and late.relayed >= 50, 20, what="the late engine's backlog")
    assert len([k for k in blocks if late.credits((k.block_hash, 0))]) == 50
    # Its backlog goes out a step's share at a time.
    assert len(late.take()) == 3 and len(late.take()) == 3
    for f in (a, late):
        f.close()
    plane.close()


def test_malformed_entries_are_skipped_and_later_ones_relayed(redis_url: str) -> None:
    plane = RedisDataPlane(RedisSettings.from_url(redis_url))
    client = redis.Redis.from_url(redis_url)
    key = announcement_key("fleet")
    client.xadd(key, {"o": "s", "e": "x"})  # fields missing
    client.xadd(key, {"junk": "1"})
    good = Announcement(True, "other", b"g" * 32, 0, None, (1, 2, 3, 4))
    client.set(CODEC.marker_key(good.block_hash, 0), b"1", ex=100)
    f = make_feed(plane, "me")
    wait_for_events(f, lambda evs: f.caught_up)
    got = wait_for_events(
        f,
        lambda evs: len(evs) >= 1,
        lambda: client.xadd(key, dict(zip(good.fields()[::2], good.fields()[1::2], strict=True))),
    )
    assert [e.token_ids for e in got] == [[1, 2, 3, 4]] and f.failures == 0
    # A whole batch of malformed entries is read past, not read again and again.
    for _ in range(fleet_blocks.BATCH):
        client.xadd(key, {"junk": "1"})
    later = Announcement(True, "other", b"k" * 32, 0, None, (5, 6, 7, 8))
    client.set(CODEC.marker_key(later.block_hash, 0), b"1", ex=100)
    got = wait_for_events(
        f,
        lambda evs: len(evs) >= 1,
        lambda: client.xadd(key, dict(zip(later.fields()[::2], later.fields()[1::2], strict=True))),
    )
    assert [e.token_ids for e in got] == [[5, 6, 7, 8]] and f.failures == 0
    f.close()
    plane.close()


def test_with_redis_away_nothing_is_announced_and_nothing_waits(own_redis) -> None:  # type: ignore[no-untyped-def]
    plane = RedisDataPlane(RedisSettings.from_url(own_redis.url, op_timeout_s=0.2))
    f = make_feed(plane, "a")
    own_redis.stop()
    f.announce_stored([block(i) for i in range(10)])  # queues only: no I/O here
    f.announce_removed([block(0).block_hash], [0])
    wait_until(lambda: f.failures >= 3, 20, what="three failed round trips")
    assert f.announced == 0 and f.relayed == 0
    # Nothing from other engines and no removal of the blocks it could not check.
    assert f.take() == []
    f.close()
    assert f._thread is not None
    f._thread.join(5.0)  # each round trip is bounded by op_timeout_s
    assert not f._thread.is_alive()
    plane.close()


def test_stored_events_carry_the_tier_and_go_to_the_fleet(redis_url: str) -> None:
    plane = RedisDataPlane(RedisSettings.from_url(redis_url))
    client = redis.Redis.from_url(redis_url)
    feed = make_feed(plane, "a")
    events = StoredBlockEvents(4, 1, SPECS, feed=feed)
    blocks = [block(i) for i in range(3)]
    for b in blocks:
        client.set(CODEC.marker_key(b.block_hash, 0), b"1", ex=100)
    events.track(1, blocks)
    events.note_store_report(1, 1, False)
    own = events.take()
    assert [(e.ownership, e.medium, e.locality) for e in own] == [
        ("umbp-redis", "REDIS", "REMOTE")
    ] * 3
    wait_until(lambda: feed.announced >= 3, 20, what="three announcements")
    entries: Any = client.xrange(announcement_key("fleet"))
    anns = [parse_announcement([x for kv in e[1].items() for x in kv]) for e in entries]
    assert [a.block_hash if a else None for a in anns] == [b.block_hash for b in blocks]
    # Stored again within the window: not announced again; after a removal it is.
    events.track(2, blocks[:1])
    events.note_store_report(2, 1, False)
    assert events.take() == []
    events.note_removed([blocks[0].block_hash], [0])
    removed = events.take()
    assert [type(e).__name__ for e in removed] == ["BlockRemoved"]
    assert removed[0].ownership == "umbp-redis"
    events.track(3, blocks[:1])
    events.note_store_report(3, 1, False)
    assert [type(e).__name__ for e in events.take()] == ["BlockStored"]
    feed.close()
    plane.close()


def test_a_credit_taken_again_during_a_check_is_kept(redis_url: str) -> None:
    """A block the check found gone but announced stored again meanwhile stays credited."""
    plane = RedisDataPlane(RedisSettings.from_url(redis_url))
    f = FleetBlockFeed(plane, CODEC, "a", 4, SPECS, ttl_s=100, timeout_s=2.0, verify_grace_s=0.0)
    b = block(1)
    f.announce_stored([b])
    real = f._markers_exist
    again = threading.Event()

    def exists_then_restored(blocks):  # type: ignore[no-untyped-def]
        out = real(blocks)  # no marker: reads 0
        f.announce_stored([b])  # stored again while the check ran
        again.set()
        return out

    f._markers_exist = exists_then_restored  # type: ignore[method-assign]
    f._verify()
    assert again.is_set() and f.credits((b.block_hash, 0)) and f.take() == []
    plane.close()
