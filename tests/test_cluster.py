"""The data plane against real Redis Clusters (3 masters + 3 replicas on loopback)."""

from __future__ import annotations

import binascii
import json
import os
import random
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
from helpers import check_fleet_feed, check_stored_markers, cli, documented_acl, fill
from keys import block_hash, block_keys, counter_prefix, rank_prefixes
from typed_redis import raw
from waiting import wait_until

from umbp_redis.data import BlockIdentityCodec, RankTopology, UMBPNamespace
from umbp_redis.store.cluster import ClusterDataPlane
from umbp_redis.store.commands import ClusterLookupEncoder
from umbp_redis.store.deployment import PendingPlane, open_plane
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.slots import SLOTS, key_slot, parse_cluster_shards, parse_cluster_slots
from umbp_redis.testing.embedded_cluster import EmbeddedCluster
from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port

FP = b"\x05" * 16
SIZE = 4096
# What a call must not depend on, where a test shows what bounds it: an hour.
HOUR = 3600.0


@pytest.fixture(scope="module")
def cluster() -> Iterator[EmbeddedCluster]:
    """One 3-master, 3-replica cluster for the tests that do not break it."""
    with EmbeddedCluster() as c:
        yield c


@pytest.fixture
def clean_cluster(cluster: EmbeddedCluster) -> EmbeddedCluster:
    for n in cluster.current_masters():
        c = cluster.client(n)
        c.flushall()
        c.close()
    return cluster


def cluster_plane(url: str, **kw) -> ClusterDataPlane:  # type: ignore[no-untyped-def]
    plane = open_plane(RedisSettings.from_url(url, **kw))
    assert isinstance(plane, ClusterDataPlane)
    return plane


def byte_keys(n: int, tag: str = "c") -> list[bytes]:
    """``block_keys`` as the cluster client reads them back (bytes)."""
    return [k.encode() for k in block_keys(n, tag)]


def payloads(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (n, SIZE), dtype=np.uint8)


def key_in_slot(slot: int, tag: str = "s") -> bytes:
    codec = BlockIdentityCodec("test")
    for i in range(1_000_000):
        k = codec.key(block_hash(tag, i), 0).encode()
        if key_slot(k) == slot:
            return k
    raise AssertionError("no key found")


# --- slots and maps -------------------------------------------------------------------


def test_a_node_whose_bus_port_was_taken_starts_on_other_ports() -> None:
    """Ports are chosen before the nodes start; one taken meanwhile (here the first
    master's bus port, held by a listening socket) moves that node to another pair,
    and the cluster forms. Nodes' ports lie below the kernel's ephemeral range, where
    outgoing connections never take them."""
    cl = EmbeddedCluster(masters=3, replicas_per_master=0)
    first = cl.masters[0].port
    lo = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(n.port + 10000 < lo for n in cl.nodes)
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", first + 10000))
        squatter.listen()
        with cl:
            assert cl.masters[0].port != first
            info = cl.client(cl.masters[0]).execute_command("CLUSTER", "INFO").decode()
            assert "cluster_state:ok" in info


def test_a_server_whose_chosen_port_was_taken_starts_on_another() -> None:
    """``EmbeddedRedis()`` picks a free port; one taken before the server binds it
    (here by a listening socket) is replaced by another. A port given explicitly, or
    one a server has run on, is never replaced: the server fails to start."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen()
        taken = squatter.getsockname()[1]
        ports = iter([taken])
        chosen: list[int] = []

        def choose() -> int:
            chosen.append(next(ports, None) or free_port())
            return chosen[-1]

        with EmbeddedRedis(choose_port=choose) as srv:
            assert chosen[0] == taken and srv.port == chosen[-1] != taken
            assert redis.Redis.from_url(srv.url).ping()
            srv.stop()  # once started, a restart keeps its port, taken or not
            with socket.socket() as again:
                again.bind(("127.0.0.1", srv.port))
                again.listen()
                with pytest.raises(RuntimeError, match="Address already in use"):
                    srv.start()
        pinned = EmbeddedRedis(port=taken)
        with pytest.raises(RuntimeError, match="Address already in use"):
            pinned.start()
        pinned.cleanup()


def test_key_slot_is_the_servers(cluster: EmbeddedCluster) -> None:
    c = cluster.client(cluster.masters[0])
    rng = random.Random(3)
    keys = [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 40))) for _ in range(300)]
    keys += [b"{user1000}.following", b"foo{}{bar}", b"foo{{bar}}zap", b"{}x", b"a{b}c{d}"]
    for k in keys:
        assert key_slot(k) == c.execute_command("CLUSTER", "KEYSLOT", k), k
    c.close()


def test_keys_never_carry_hash_tags() -> None:
    """A key's slot is the CRC16 of the whole key: no namespace can add a {tag}."""
    for bad in ("ns{x}", "{ns}", "a}b", "a{b"):
        with pytest.raises(ValueError, match="key_namespace"):
            UMBPNamespace(bad)
    ns = UMBPNamespace("team.a-1")
    codec = BlockIdentityCodec(ns.value, RankTopology(tp_rank=3, tp_size=4))
    key = codec.key(b"\xab" * 32, 0).encode()
    assert key_slot(key) == binascii.crc_hqx(key, 0) % SLOTS


def test_slot_map_read_from_the_cluster_matches_cluster_slots(cluster: EmbeddedCluster) -> None:
    plane = cluster_plane(cluster.url)
    m = plane.slot_map
    assert m is not None and m.covered == SLOTS and len(m.masters) == 3
    assert all(len(r) == 1 for r in m.replicas)
    c = cluster.client(cluster.masters[1])
    for lo, hi, master, *_ in c.execute_command("CLUSTER", "SLOTS"):
        for s in (lo, (lo + hi) // 2, hi):
            assert m.node_of(s) == (master[0].decode(), master[1])
    c.close()
    plane.close()


def test_map_parsers_handle_unknown_endpoints_and_failed_nodes() -> None:
    shards = [
        [
            b"slots",
            [0, 99],
            b"nodes",
            [
                [
                    b"id",
                    b"a",
                    b"port",
                    7000,
                    b"ip",
                    b"10.0.0.1",
                    b"endpoint",
                    b"?",
                    b"role",
                    b"master",
                    b"health",
                    b"online",
                ],
                [
                    b"id",
                    b"b",
                    b"port",
                    7003,
                    b"ip",
                    b"10.0.0.4",
                    b"endpoint",
                    b"10.0.0.4",
                    b"role",
                    b"replica",
                    b"health",
                    b"online",
                ],
            ],
        ],
        [
            b"slots",
            [100, 16383],
            b"nodes",
            [
                [
                    b"id",
                    b"c",
                    b"port",
                    7001,
                    b"endpoint",
                    b"",
                    b"role",
                    b"master",
                    b"health",
                    b"online",
                ],
            ],
        ],
        [  # a shard whose master failed: its slots are served by nobody
            b"slots",
            [],
            b"nodes",
            [
                [
                    b"id",
                    b"d",
                    b"port",
                    7002,
                    b"endpoint",
                    b"10.0.0.3",
                    b"role",
                    b"master",
                    b"health",
                    b"fail",
                ]
            ],
        ],
    ]
    m = parse_cluster_shards(shards, "seed-host")
    assert m.node_of(0) == ("10.0.0.1", 7000)  # "?" falls back to the IP
    assert m.node_of(100) == ("seed-host", 7001)  # empty: the node we asked
    assert m.replicas[0] == (("10.0.0.4", 7003),)
    assert m.covered == SLOTS and len(m.masters) == 2
    node_a: Any = shards[0][3]
    node_a[0].extend([b"tls-port", 7100])
    assert parse_cluster_shards(shards, "seed-host").node_of(0) == ("10.0.0.1", 7000)
    assert parse_cluster_shards(shards, "seed-host", tls=True).node_of(0) == ("10.0.0.1", 7100)
    assert parse_cluster_shards(shards, "seed-host", tls=True).node_of(100) == ("seed-host", 7001)
    slots = [[0, 8191, [None, 7000, b"id"]], [8192, 16000, [b"h2", 7001, b"id2"], [b"h3", 7004]]]
    m2 = parse_cluster_slots(slots, "asked")
    assert m2.node_of(5) == ("asked", 7000)
    assert m2.node_of(16000) == ("h2", 7001) and m2.node_of(16001) is None
    assert m2.covered == 16001


# --- data path --------------------------------------------------------------------------


def test_keys_spread_over_every_master_and_results_equal_standalone(
    clean_cluster: EmbeddedCluster, redis_url: str
) -> None:
    plane = cluster_plane(clean_cluster.url)
    single = RedisDataPlane(RedisSettings.from_url(redis_url))
    keys = byte_keys(90)
    data = payloads(90)
    for p in (plane, single):
        items = [(k, data[i]) for i, k in enumerate(keys[:60])]
        assert p.store(items, FP) == [StoreStatus.STORED] * 60
    sizes = []
    for n in clean_cluster.current_masters():
        c = clean_cluster.client(n)
        sizes.append(c.dbsize())
        c.close()
    assert len(sizes) == 3 and all(s >= 8 for s in sizes) and sum(sizes) == 60
    # One invalid value (another key's bytes) on both deployments.
    rc = clean_cluster.cluster_client()
    rs = redis.Redis.from_url(redis_url)
    for r in (rc, rs):
        r.hset(keys[1], "b", raw(r.hget(keys[2], "b")))
    rc.close()
    for p in (plane, single):
        out = np.zeros_like(data)
        res = p.load([(k, out[i]) for i, k in enumerate(keys)], FP)
        assert res[1] is LoadStatus.INVALID
        assert res[60:] == [LoadStatus.MISSING] * 30
        assert all(res[i] is LoadStatus.LOADED for i in range(60) if i != 1)
        assert np.array_equal(out[2:60], data[2:60])
    assert plane.lookup(keys) == single.lookup(keys) == [i < 60 for i in range(90)]
    assert plane.lookup(keys, refresh_ttl=False) == [i < 60 for i in range(90)]
    assert plane.delete(keys) == single.delete(keys) == 60
    assert plane.lookup(keys) == [False] * 90
    assert plane.counters()["cluster_node_failures"] == 0
    plane.close()
    single.close()


def test_block_lookups_cover_every_rank_key_in_one_call(clean_cluster: EmbeddedCluster) -> None:
    plane = cluster_plane(clean_cluster.url)
    prefixes = rank_prefixes("ns", tp_size=4)
    enc = plane.lookup_encoder(prefixes, refresh_ttl=True, hash_hex_len=64)
    assert isinstance(enc, ClusterLookupEncoder) and enc.replies == 4
    hashes = [f"{i:064x}".encode() for i in range(50)]
    # Blocks 0-19 complete, block 20 lacks rank 3's key.
    rc = clean_cluster.cluster_client()
    for i in range(21):
        for r, p in enumerate(prefixes):
            if i < 20 or r < 3:
                rc.set(p + hashes[i], b"x")
    blocks = [enc.encode(h) for h in hashes]
    assert len({n for b in blocks for n in b.slots}) > 50  # keys of one block spread out
    replies = plane.lookup_blocks(blocks, 200)
    assert replies is not None
    complete = [sum(replies[4 * i : 4 * i + 4]) == 4 for i in range(50)]
    assert complete == [i < 20 for i in range(50)]
    assert rc.ttl(prefixes[0] + hashes[0]) > 0  # EXPIRE re-armed (set) the TTL on the master
    rc.close()
    plane.close()


def test_request_counts_ride_with_a_cluster_lookup_and_keep_their_values(
    clean_cluster: EmbeddedCluster,
) -> None:
    plane = cluster_plane(clean_cluster.url)
    (prefix,) = rank_prefixes("ns")
    enc = plane.lookup_encoder([prefix], refresh_ttl=True, hash_hex_len=64)
    cnt = plane.request_count_encoder(counter_prefix("ns"), hash_hex_len=64)
    hashes = [f"{i:064x}".encode() for i in range(30)]
    rc = clean_cluster.cluster_client()
    rc.set(prefix + hashes[0], b"x")
    blocks = [enc.encode(h) for h in hashes] + [cnt.encode(h) for h in hashes]
    assert len({b.slots[0] for b in blocks[30:]}) > 20  # counters spread over the masters
    for n in (1, 2, 3):
        replies = plane.lookup_blocks(blocks, 90, counted_from=30)
        assert replies is not None
        assert replies[:30] == [1] + [0] * 29
        assert replies[30::2] == [n] * 30 and replies[31::2] == [1] * 30
    assert plane.counters()["cluster_node_failures"] == 0
    rc.close()
    plane.close()


def test_stored_markers_are_written_refreshed_and_removed_on_every_master(
    clean_cluster: EmbeddedCluster,
) -> None:
    plane = cluster_plane(clean_cluster.url)
    rc = clean_cluster.cluster_client()
    check_stored_markers(plane, rc)
    masters = {rc.get_node_from_key(k).name for k in rc.scan_iter(match="*:stored:*")}
    assert len(masters) == 3  # the markers spread over the masters, each sent to its own
    assert plane.counters()["cluster_node_failures"] == 0
    rc.close()
    plane.close()


def test_fleet_announcements_reach_every_engine_on_a_cluster(
    clean_cluster: EmbeddedCluster,
) -> None:
    plane = cluster_plane(clean_cluster.url)
    rc = clean_cluster.cluster_client()
    check_fleet_feed(plane, rc)
    assert plane.counters()["cluster_node_failures"] == 0
    rc.close()
    plane.close()


def test_stale_map_follows_moved(clean_cluster: EmbeddedCluster) -> None:
    plane = cluster_plane(clean_cluster.url)
    m = plane.slot_map
    assert m is not None
    slot = 5  # served by the first master
    src = m.node_of(slot)
    dst = next(a for a in m.masters if a != src)
    assert src is not None
    clients = [clean_cluster.client(n) for n in clean_cluster.current_masters()]
    dst_id = redis.Redis(host=dst[0], port=dst[1]).execute_command("CLUSTER", "MYID").decode()
    for c in clients:  # the slot is empty: hand it over at once
        c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
    key = key_in_slot(slot)
    data = payloads(1)
    try:
        assert plane.store([(key, data[0])], FP) == [StoreStatus.STORED]
        assert plane.counters()["cluster_moved"] >= 1
        assert redis.Redis(host=dst[0], port=dst[1]).exists(key) == 1
        out = np.zeros_like(data)
        assert plane.load([(key, out[0])], FP) == [LoadStatus.LOADED]
        assert np.array_equal(out, data)
        wait_until(
            lambda: plane.slot_map is not None and plane.slot_map.node_of(slot) == dst,
            what="the slot map to name the new owner",
        )
    finally:
        src_id = redis.Redis(host=src[0], port=src[1]).execute_command("CLUSTER", "MYID")
        redis.Redis(host=dst[0], port=dst[1]).delete(key)
        for c in clients:
            c.execute_command("CLUSTER", "SETSLOT", slot, "NODE", src_id.decode())
            c.close()
        plane.close()


def test_migrating_slot_follows_ask(clean_cluster: EmbeddedCluster) -> None:
    plane = cluster_plane(clean_cluster.url)
    m = plane.slot_map
    assert m is not None
    slot = 6
    src = m.node_of(slot)
    dst = next(a for a in m.masters if a != src)
    assert src is not None and src != dst
    rsrc = redis.Redis(host=src[0], port=src[1])
    rdst = redis.Redis(host=dst[0], port=dst[1])
    src_id = rsrc.execute_command("CLUSTER", "MYID").decode()
    dst_id = rdst.execute_command("CLUSTER", "MYID").decode()
    rdst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    rsrc.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    key = key_in_slot(slot, "ask")
    data = payloads(1, seed=4)
    try:
        # The key is not on the source: the source answers ASK and the target takes it.
        assert plane.store([(key, data[0])], FP) == [StoreStatus.STORED]
        assert plane.counters()["cluster_ask"] >= 1
        assert rsrc.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 0
        assert rdst.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot) == 1
        out = np.zeros_like(data)
        assert plane.load([(key, out[0])], FP) == [LoadStatus.LOADED]
        assert np.array_equal(out, data)
        assert plane.counters()["cluster_ask"] >= 2
        assert plane.slot_map is not None and plane.slot_map.node_of(slot) == src  # not moved
    finally:
        for c in clean_cluster.current_masters():
            r = clean_cluster.client(c)
            r.execute_command("CLUSTER", "SETSLOT", slot, "NODE", src_id)
            r.close()
        rdst.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        rsrc.execute_command("CLUSTER", "SETSLOT", slot, "STABLE")
        plane.close()


def test_database_other_than_zero_on_a_cluster_is_a_startup_error(
    cluster: EmbeddedCluster,
) -> None:
    url = cluster.url.rsplit("/", 1)[0] + "/2"
    with pytest.raises(ConfigError, match="redis_url.*database 2"):
        open_plane(RedisSettings.from_url(url))
    with pytest.raises(ConfigError, match="cluster"):
        RedisSettings.from_url(url, cluster=True)
    with pytest.raises(ConfigError, match="cluster_seed_nodes"):
        RedisSettings.from_url(cluster.url, cluster_seed_nodes=["nohost"])
    with pytest.raises(ConfigError, match="'cluster'"):
        RedisSettings.from_url(cluster.url, cluster="maybe")


def test_auto_detection_and_a_server_that_comes_later(
    cluster: EmbeddedCluster, redis_url: str
) -> None:
    assert isinstance(open_plane(RedisSettings.from_url(redis_url)), RedisDataPlane)
    assert isinstance(open_plane(RedisSettings.from_url(cluster.url)), ClusterDataPlane)
    plane = open_plane(RedisSettings.from_url(cluster.url, cluster=False))
    assert isinstance(plane, RedisDataPlane)
    plane.close()
    port = free_port()
    pending = open_plane(
        RedisSettings.from_url(f"redis://127.0.0.1:{port}/0", connect_timeout_s=0.2)
    )
    assert isinstance(pending, PendingPlane) and pending.lookup_mode == "pending"
    assert pending.store([(b"k", b"v" * 8)], FP) == [StoreStatus.ERROR]
    with EmbeddedRedis(port=port):
        wait_until(lambda: pending.inner is not None, what="the pending plane to open")
        assert pending.lookup_mode == "standalone"
        assert pending.store([(b"k", b"v" * 8)], FP) == [StoreStatus.STORED]
    pending.close()


# --- failures ---------------------------------------------------------------------------


def _check_loop_step(
    plane: ClusterDataPlane,
    keys: list[bytes],
    data: np.ndarray,
    *,
    store: bool = True,
) -> tuple[int, int]:
    """One lookup, (store) and load round; returns (stored, loaded) and checks bytes.
    Each call returning at all is what bounds it: no call is timed."""
    assert plane.lookup(keys) is not None  # a failed master's keys are misses, not None
    stored = 0
    if store:
        st = plane.store([(k, data[i]) for i, k in enumerate(keys)], FP)
        stored = sum(s is StoreStatus.STORED for s in st)
    out = np.zeros_like(data)
    res = plane.load([(k, out[i]) for i, k in enumerate(keys)], FP)
    for i, r in enumerate(res):
        if r is LoadStatus.LOADED:
            assert np.array_equal(out[i], data[i])  # never a wrong byte
        else:
            assert r in (LoadStatus.MISSING, LoadStatus.ERROR)
    return stored, sum(r is LoadStatus.LOADED for r in res)


def test_master_killed_during_lookup_store_load_loop() -> None:
    """A crashed master costs only its own keys (misses, never a wrong byte) until its
    replica is promoted, then every key hits again. Connects and operations may take an
    hour: the loop going on at all shows that no call waited on the dead master (its
    connections are refused or reset) and that lookups end by ``lookup_timeout_s``. A
    hang is stopped by pytest-timeout; the failover itself is waited for generously."""
    with EmbeddedCluster(node_timeout_ms=1000) as cl:
        plane = cluster_plane(
            cl.url,
            op_timeout_s=HOUR,
            connect_timeout_s=HOUR,
            lookup_timeout_s=0.25,
            fail_fast_s=0.5,
        )
        keys = byte_keys(48, "kill")
        data = payloads(48, seed=9)
        assert _check_loop_step(plane, keys, data) == (48, 48)
        for n in cl.masters:  # the replicas have every value before the crash
            c = cl.client(n)
            assert c.execute_command("WAIT", 1, 5000) == 1
            c.close()
        cl.masters[0].kill()
        seen: list[int] = []  # values loaded per round

        def every_value_loads() -> bool:
            # Lookups and loads only: what comes back is what the promoted replica holds.
            _, loaded = _check_loop_step(plane, keys, data, store=False)
            seen.append(loaded)
            return loaded == 48

        # node timeout (1 s) + election + one refresh, with room for a slow machine
        wait_until(
            every_value_loads,
            60,
            what=lambda: f"hits back after the failover (loaded per round: {seen[-5:]})",
            poll_s=0.05,
        )
        assert min(seen) < 48  # the victim's keys missed for a while
        wait_until(lambda: plane.lookup(keys) == [True] * 48, what="every lookup to hit")
        assert _check_loop_step(plane, keys, data) == (48, 48)
        counters = plane.counters()
        assert counters["cluster_node_failures"] >= 1
        assert counters["cluster_map_refreshes"] >= 1
        assert len(plane.slot_map.masters if plane.slot_map else ()) == 3
        plane.close()


def test_clusterdown_with_full_coverage_is_a_miss_then_recovers() -> None:
    with EmbeddedCluster(replicas_per_master=0, node_timeout_ms=500, full_coverage=True) as cl:
        # CLUSTERDOWN is an answer and the dead node refuses: nothing waits on a timeout.
        plane = cluster_plane(cl.url, op_timeout_s=HOUR, connect_timeout_s=HOUR, fail_fast_s=0.3)
        keys = byte_keys(30, "down")
        data = payloads(30, seed=2)
        assert (
            plane.store([(k, data[i]) for i, k in enumerate(keys)], FP) == [StoreStatus.STORED] * 30
        )
        victim = cl.masters[2]
        victim.kill()
        survivor = cl.client(cl.masters[0])
        wait_until(
            lambda: "cluster_state:fail" in survivor.execute_command("CLUSTER", "INFO").decode(),
            30,
            what="the cluster to fail",
            poll_s=0.1,
        )
        # Every node now answers CLUSTERDOWN: misses and failed stores, no exception.
        stored, loaded = _check_loop_step(plane, keys, data)
        assert (stored, loaded) == (0, 0)
        assert plane.lookup(keys) == [False] * 30
        victim.start()
        cl.wait_healthy()
        last: list[tuple[int, int]] = []

        def all_stored_and_loaded() -> bool:
            last.append(_check_loop_step(plane, keys, data))
            return last[-1] == (30, 30)

        wait_until(
            all_stored_and_loaded,
            30,
            what=lambda: f"stores and loads to succeed again (last: {last[-1:]})",
            poll_s=0.1,
        )
        survivor.close()
        plane.close()


# --- operator commands --------------------------------------------------------------


def test_cli_verbs_cover_every_master(clean_cluster: EmbeddedCluster) -> None:
    url = clean_cluster.url
    keys_a = fill(url, "nsa", 40)
    fill(url, "nsb", 10)
    ls = json.loads(cli("ls", "--redis-url", url, "--json", "--limit", "100").stdout)
    assert ls["namespaces"] == {"nsa": 40, "nsb": 10} and len(ls["keys"]) == 50
    st = json.loads(cli("stats", "--redis-url", url, "--json").stdout)
    assert st["namespaces"]["nsa"]["keys"] == 40
    assert st["server"]["masters"] == 3 and len(st["nodes"]) == 3
    assert st["server"]["maxmemory_policy"] == "allkeys-lru"
    insp = cli("inspect", "--redis-url", url, "--json", keys_a[7])
    assert insp.returncode == 0 and json.loads(insp.stdout)["valid"] is True
    purge = cli("purge", "--redis-url", url, "--namespace", "nsb", "--yes", "--json")
    assert json.loads(purge.stdout)["deleted"] == 10
    ls = json.loads(cli("ls", "--redis-url", url, "--json").stdout)
    assert ls["namespaces"] == {"nsa": 40}
    doc = cli("doctor", "--redis-url", url, "--json")
    report = json.loads(doc.stdout)
    assert doc.returncode == 0 and report["ok"] and report["cluster"]
    by_check: dict[str, list[str]] = {}
    for c in report["checks"]:
        by_check.setdefault(c["check"], []).append(c["level"])
    assert by_check["cluster state"] == ["ok"] and by_check["slot coverage"] == ["ok"]
    assert by_check["replicas"] == ["ok"] * 3 and by_check["full coverage"] == ["ok"] * 3
    assert by_check["eviction"] == ["ok"] * 3
    # --cluster false talks to the one node named: it sees only that master's keys.
    one = json.loads(cli("ls", "--redis-url", url, "--json", "--cluster", "false").stdout)
    assert 0 < one["namespaces"]["nsa"] < 40


def test_doctor_warns_about_full_coverage_and_masters_without_replicas() -> None:
    with EmbeddedCluster(replicas_per_master=0, full_coverage=True) as cl:
        report = json.loads(cli("doctor", "--redis-url", cl.url, "--json").stdout)
    levels = {(c["check"], c["level"]) for c in report["checks"]}
    assert ("replicas", "warn") in levels and ("full coverage", "warn") in levels
    assert report["ok"]  # warnings, not failures


@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None,
    reason="bench cluster needs root, ip and tc (network namespaces)",
)
def test_bench_cluster_runs_and_removes_what_it_made() -> None:
    before = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    out = cli("bench", "cluster", "--json", "--total-mib", "12", "--repeats", "1")
    assert out.returncode == 0, out.stderr
    res = json.loads(out.stdout)
    # Every transfer was checked byte for byte inside the bench; figures are positive.
    for k in ("store_gbps_1_node", "store_gbps_3_masters", "load_gbps_1_node"):
        assert res[k] > 0
    assert res["objects"] == 6 and res["lookup_keys"] == 1000
    after = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert after.count("\n") == before.count("\n")
    assert (
        "ub" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    )


def test_the_documented_minimal_acl_works_on_a_cluster(clean_cluster: EmbeddedCluster) -> None:
    for n in clean_cluster.nodes:  # ACLs are per node
        c = clean_cluster.client(n)
        c.execute_command(*documented_acl())
        c.close()
    url = clean_cluster.url.replace("redis://", "redis://umbp:acl-pass@")
    plane = cluster_plane(url)
    keys = byte_keys(30, "acl")
    data = payloads(30, seed=6)
    assert plane.store([(k, data[i]) for i, k in enumerate(keys)], FP) == [StoreStatus.STORED] * 30
    assert plane.lookup(keys) == [True] * 30
    out = np.zeros_like(data)
    assert plane.load([(k, out[i]) for i, k in enumerate(keys)], FP) == [LoadStatus.LOADED] * 30
    assert np.array_equal(out, data)
    assert plane.delete(keys) == 30
    rc = clean_cluster.cluster_client()
    check_stored_markers(plane, rc)  # SET, EXPIRE, UNLINK of markers and values
    rc.close()
    assert plane.counters()["auth_failures"] == 0
    plane.close()


def test_seed_nodes_serve_when_the_url_node_is_down(clean_cluster: EmbeddedCluster) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    seeds = [f"127.0.0.1:{n.port}" for n in clean_cluster.replicas]
    plane = open_plane(
        RedisSettings.from_url(dead, cluster=True, cluster_seed_nodes=seeds, connect_timeout_s=0.2)
    )
    assert isinstance(plane, ClusterDataPlane)
    m = wait_until(lambda: plane.slot_map, what="a slot map read from a seed node")
    assert m is not None and m.covered == SLOTS  # read from a replica: masters listed
    keys = byte_keys(10, "seed")
    data = payloads(10, seed=8)
    assert plane.store([(k, data[i]) for i, k in enumerate(keys)], FP) == [StoreStatus.STORED] * 10
    plane.close()


def test_on_loaded_indices_are_the_callers_across_masters(clean_cluster: EmbeddedCluster) -> None:
    plane = cluster_plane(clean_cluster.url)
    keys = byte_keys(24, "ol")
    data = payloads(24, seed=6)
    assert plane.store(list(zip(keys, data, strict=True)), FP) == [StoreStatus.STORED] * 24
    plane.delete([keys[5]])
    dest = np.zeros_like(data)
    seen: list[int] = []
    not_in_place: list[int] = []
    lock = threading.Lock()

    def on_loaded(done: list[int]) -> None:
        with lock:  # reported from each master's transfer thread
            seen.extend(done)
            # An index is reported only once its value is in place.
            not_in_place.extend(i for i in done if not np.array_equal(dest[i], data[i]))

    st = plane.load([(k, memoryview(dest[i])) for i, k in enumerate(keys)], FP, on_loaded=on_loaded)
    assert sorted(seen) == [i for i, s in enumerate(st) if s is LoadStatus.LOADED]
    assert sorted(seen) == [i for i in range(24) if i != 5] and not_in_place == []
    plane.close()


def test_values_in_parts_load_by_part_across_masters(clean_cluster: EmbeddedCluster) -> None:
    """Loads by part through the cluster client: every key's parts are reported once,
    in order, with the caller's indices, their bytes in place when reported."""
    plane = cluster_plane(clean_cluster.url)
    keys = byte_keys(18, "parts")
    data = payloads(18, seed=12)
    size = data.shape[1]
    parts = (size // 4, size // 4, size - 2 * (size // 4))
    starts = np.cumsum((0,) + parts)
    assert (
        plane.store(list(zip(keys, data, strict=True)), FP, parts=parts)
        == [StoreStatus.STORED] * 18
    )
    dest = np.zeros_like(data)
    seen: dict[int, list[int]] = {}
    wrong: list[tuple[int, int]] = []
    lock = threading.Lock()

    def on_part(part: int, done: list[int]) -> None:
        with lock:
            for i in done:
                seen.setdefault(i, []).append(part)
                lo, hi = starts[part], starts[part + 1]
                if not np.array_equal(dest[i, lo:hi], data[i, lo:hi]):
                    wrong.append((i, part))

    items = [(k, memoryview(dest[i])) for i, k in enumerate(keys)]
    st = plane.load(items, FP, parts=parts, on_part=on_part)
    assert st == [LoadStatus.LOADED] * 18 and np.array_equal(dest, data)
    assert seen == {i: [0, 1, 2] for i in range(18)} and wrong == []
    plane.close()
