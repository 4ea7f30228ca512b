"""``umbp-redis bench cluster``: one node against three masters, each behind a slow link.

Every Redis node runs in its own network namespace behind a veth pair whose two ends
are rate limited with ``tc`` (token bucket, ``--rate-mbit`` each way), all on one
bridge; so the network, not this machine's CPU, bounds each node, as in a fleet. In
one run, interleaved, it measures store and load throughput of 2 MiB objects against
one standalone node and against a 3-master cluster, and the p50 of a 1000-key lookup
(the scheduler's encoded per-rank lookups) against both. Needs root (``ip netns``).
Everything it creates is named after its process id and removed at the end.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable
from contextlib import ExitStack
from typing import Any, TextIO

import numpy as np

from umbp_redis.data import BlockIdentityCodec, RankTopology
from umbp_redis.store.cluster import ClusterDataPlane
from umbp_redis.store.deployment import DataPlane
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_cluster import cluster_node_args, form_cluster
from umbp_redis.testing.slow_link import PORT, NetworkSetupError, SlowLinkNode, add_bridge

FINGERPRINT = b"\x0b" * 16
SUBNET = "10.213.0"

__all__ = ["NetworkSetupError", "format_cluster_table", "run_cluster_bench"]


def _objects(count: int, size: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, size), dtype=np.uint8)


def transfer_gbps(plane: DataPlane, staging: np.ndarray, tag: str) -> tuple[float, float]:
    """(store GB/s, load GB/s) of every row of ``staging`` as one object each."""
    codec = BlockIdentityCodec(f"bench{tag}")
    keys = [codec.key(i.to_bytes(32, "big"), 0) for i in range(len(staging))]
    dest = np.zeros_like(staging)
    t0 = time.perf_counter()
    st = plane.store([(k, staging[i]) for i, k in enumerate(keys)], FINGERPRINT)
    t_store = time.perf_counter() - t0
    if any(s is not StoreStatus.STORED for s in st):
        raise RuntimeError(f"stores failed: {sorted({s.value for s in st})}")
    t0 = time.perf_counter()
    res = plane.load([(k, dest[i]) for i, k in enumerate(keys)], FINGERPRINT)
    t_load = time.perf_counter() - t0
    if any(r is not LoadStatus.LOADED for r in res) or not np.array_equal(staging, dest):
        raise RuntimeError("loads failed or differ")
    plane.delete(keys)
    return staging.nbytes / t_store / 1e9, staging.nbytes / t_load / 1e9


def lookup_p50_ms(plane: DataPlane, nkeys: int, ranks: int, rounds: int) -> float:
    """p50 ms of a lookup of ``nkeys`` keys (``ranks`` keys a block), as the scheduler
    encodes it; every key present."""
    codec = BlockIdentityCodec("benchlk", RankTopology(tp_size=ranks))
    prefixes = [p.encode() for p in codec.key_prefixes(0)]
    enc = plane.lookup_encoder(prefixes, refresh_ttl=True, hash_hex_len=64)
    hashes = [f"{i:064x}".encode() for i in range(nkeys // ranks)]
    blocks = [enc.encode(h) for h in hashes]
    keys = [p + h for h in hashes for p in prefixes]
    st = plane.store([(k, b"x" * 64) for k in keys], FINGERPRINT)
    if any(s is not StoreStatus.STORED for s in st):
        raise RuntimeError("lookup keys not stored")
    count = len(keys)
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        replies = plane.lookup_blocks(blocks, count)
        times.append((time.perf_counter() - t0) * 1e3)
        if replies is None or sum(replies) != count:
            raise RuntimeError("lookup missed present keys")
    plane.delete(keys)
    return statistics.median(times)


def run_cluster_bench(
    *,
    rate_mbit: int = 1600,
    object_bytes: int = 2 << 20,
    total_mib: int = 192,
    repeats: int = 3,
    lookup_keys: int = 1000,
    progress: TextIO | None = None,
) -> dict[str, Any]:
    """Set up 1 + 3 slow-link nodes, measure, tear down; the figures and their ratios."""
    if os.geteuid() != 0:
        raise NetworkSetupError("bench cluster needs root (it makes network namespaces)")
    tag = f"ub{os.getpid() % 100000}"
    bridge = f"{tag}br"

    def say(msg: str) -> None:
        if progress is not None:
            print(msg, file=progress, flush=True)

    with ExitStack() as stack:
        add_bridge(bridge, SUBNET, stack)
        single_args = ["--maxmemory-policy", "allkeys-lru"]
        cluster_args = cluster_node_args(2000, False)
        nodes = []
        for i, args in enumerate([single_args] + [cluster_args] * 3):
            node = SlowLinkNode(tag, i, bridge, rate_mbit, args, subnet=SUBNET)
            stack.callback(node.stop)
            nodes.append(node.start())
        say(f"nodes up behind {rate_mbit} Mbit/s links; forming the cluster")
        form_cluster([(n.ip, n.port) for n in nodes[1:]], [])
        single = RedisDataPlane(
            RedisSettings.from_url(f"redis://{nodes[0].ip}:{PORT}/0", cluster=False)
        )
        stack.callback(single.close)
        cluster = ClusterDataPlane(
            RedisSettings.from_url(f"redis://{nodes[1].ip}:{PORT}/0", cluster=True)
        )
        stack.callback(cluster.close)
        deadline = time.monotonic() + 10
        while cluster.slot_map is None and time.monotonic() < deadline:
            time.sleep(0.05)
        count = max(3, (total_mib << 20) // object_bytes)
        staging = _objects(count, object_bytes, 1)
        runs: dict[str, list[float]] = {
            k: [] for k in ("store_1", "load_1", "store_3", "load_3", "lookup_1", "lookup_3")
        }
        measure: list[tuple[str, Callable[[], None]]] = [
            ("1", lambda: _record(runs, "1", transfer_gbps(single, staging, "s"))),
            ("3", lambda: _record(runs, "3", transfer_gbps(cluster, staging, "c"))),
        ]
        for r in range(repeats):  # interleaved: drift hits both alike
            for _which, fn in measure:
                fn()
            runs["lookup_1"].append(lookup_p50_ms(single, lookup_keys, 8, 30))
            runs["lookup_3"].append(lookup_p50_ms(cluster, lookup_keys, 8, 30))
            say(f"round {r + 1}/{repeats} done")
    best = {k: (max(v) if not k.startswith("lookup") else min(v)) for k, v in runs.items()}
    return {
        "rate_mbit_per_link": rate_mbit,
        "object_bytes": object_bytes,
        "objects": count,
        "lookup_keys": lookup_keys,
        "store_gbps_1_node": best["store_1"],
        "store_gbps_3_masters": best["store_3"],
        "store_ratio": best["store_3"] / best["store_1"],
        "load_gbps_1_node": best["load_1"],
        "load_gbps_3_masters": best["load_3"],
        "load_ratio": best["load_3"] / best["load_1"],
        "lookup_p50_ms_standalone": best["lookup_1"],
        "lookup_p50_ms_3_masters": best["lookup_3"],
        "lookup_ratio": best["lookup_3"] / best["lookup_1"],
        "runs": runs,
    }


def _record(runs: dict[str, list[float]], which: str, gbps: tuple[float, float]) -> None:
    runs[f"store_{which}"].append(gbps[0])
    runs[f"load_{which}"].append(gbps[1])


def format_cluster_table(res: dict[str, Any]) -> str:
    """The result as the table ``docs/performance.md`` records."""
    mb = res["object_bytes"] / (1 << 20)
    rows = [
        f"links: {res['rate_mbit_per_link']} Mbit/s each way per node; "
        f"{res['objects']} objects of {mb:g} MiB; lookups of {res['lookup_keys']} keys (8 ranks)",
        "",
        "| measure | 1 node | 3 masters | ratio | goal |",
        "|---|---|---|---|---|",
        f"| store GB/s | {res['store_gbps_1_node']:.3f} | {res['store_gbps_3_masters']:.3f} | "
        f"{res['store_ratio']:.2f}x | >= 2.4x |",
        f"| load GB/s | {res['load_gbps_1_node']:.3f} | {res['load_gbps_3_masters']:.3f} | "
        f"{res['load_ratio']:.2f}x | >= 2.4x |",
        f"| lookup p50 ms | {res['lookup_p50_ms_standalone']:.2f} | "
        f"{res['lookup_p50_ms_3_masters']:.2f} | {res['lookup_ratio']:.2f}x | <= 2x |",
    ]
    return "\n".join(rows)
