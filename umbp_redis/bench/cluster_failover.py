"""How long a killed master's values miss, and how long a load call takes meanwhile.

Usage: .venv/bin/python -m umbp_redis.bench.cluster_failover

For each cluster-node-timeout (1000 and 2000 ms) it starts a private 3-master,
3-replica cluster, stores 48 values of 4 KiB, waits until every replica has them
(``WAIT``), SIGKILLs one master, then loads all 48 in a loop (loads only: no store
repairs anything) until every value loads again. It prints the seconds from the kill
to that point, the slowest load call meanwhile and the slot-map refreshes it took.
"""

from __future__ import annotations

import time

import numpy as np

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.store.cluster import ClusterDataPlane
from umbp_redis.store.plane import LoadStatus, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_cluster import EmbeddedCluster

FINGERPRINT = b"\x01" * 16
N = 48


def measure(node_timeout_ms: int) -> tuple[float, float, int]:
    """(seconds until every value loads again, slowest load call in s, map refreshes)."""
    with EmbeddedCluster(node_timeout_ms=node_timeout_ms) as cl:
        plane = ClusterDataPlane(
            RedisSettings.from_url(cl.url, cluster=True, connect_timeout_s=0.5, op_timeout_s=1.0)
        )
        deadline = time.monotonic() + 10
        while plane.slot_map is None and time.monotonic() < deadline:
            time.sleep(0.02)
        codec = BlockIdentityCodec("bench")
        keys = [codec.key(i.to_bytes(32, "big"), 0) for i in range(N)]
        data = np.random.default_rng(0).integers(0, 256, (N, 4096), dtype=np.uint8)
        stored = plane.store([(k, data[i]) for i, k in enumerate(keys)], FINGERPRINT)
        assert stored == [StoreStatus.STORED] * N
        for n in cl.masters:
            c = cl.client(n)
            assert c.execute_command("WAIT", 1, 5000) == 1
            c.close()
        cl.masters[0].kill()
        killed = time.monotonic()
        slowest = 0.0
        while time.monotonic() - killed < 30:
            out = np.zeros_like(data)
            t0 = time.monotonic()
            res = plane.load([(k, out[i]) for i, k in enumerate(keys)], FINGERPRINT)
            slowest = max(slowest, time.monotonic() - t0)
            if all(r is LoadStatus.LOADED for r in res):
                assert np.array_equal(out, data)
                back = time.monotonic() - killed
                refreshes = plane.counters()["cluster_map_refreshes"]
                plane.close()
                return back, slowest, refreshes
            time.sleep(0.02)
        plane.close()
        raise RuntimeError("values never loaded again after the failover")


def main() -> None:
    print("node timeout ms | values back after s | slowest load call ms | map refreshes")
    for timeout_ms in (1000, 2000):
        back, slowest, refreshes = measure(timeout_ms)
        print(f"{timeout_ms:15d} | {back:19.2f} | {slowest * 1000:20.1f} | {refreshes:13d}")


if __name__ == "__main__":
    main()
