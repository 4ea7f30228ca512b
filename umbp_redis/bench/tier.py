"""Chunks through the Redis secondary tier against the connector's own data plane.

One private redis-server. For each chunk size, N chunks of a host buffer (the CPU
primary tier's rows) are stored and loaded back:

- ``tier``: ``UMBPRedisTier.submit_store`` / ``submit_load`` of the N chunks as one job
  each way, timed to the job's result (what vLLM's tiering manager sees);
- ``plane``: ``RedisDataPlane.store`` / ``load`` of the same N buffers under block keys,
  timed around the call (what the connector's workers do).

Prints GB/s (medians of the repeats, [min-max]) and tier/plane ratios.
Usage: .venv/bin/python -m umbp_redis.bench.tier [--chunks N] [--repeats R]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this benchmark uses the tests' fixtures
sys.path.insert(0, str(ROOT / "tests"))

from keys import block_keys  # noqa: E402
from test_redis_tier import Spec, finish, job, keys, offloading_config  # noqa: E402

from umbp_redis.engine.redis_tier import UMBPRedisTier  # noqa: E402
from umbp_redis.store.plane import RedisDataPlane, StoreStatus  # noqa: E402
from umbp_redis.store.settings import RedisSettings  # noqa: E402
from umbp_redis.store.value_reads import LoadStatus  # noqa: E402
from umbp_redis.testing.embedded_redis import EmbeddedRedis  # noqa: E402

FP = b"\x11" * 16


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


def run(url: str, chunk_bytes: int, n: int, repeats: int) -> dict[str, list[float]]:
    rows = np.random.default_rng(0).integers(0, 256, size=(2 * n, chunk_bytes), dtype=np.uint8)
    view = rows.data
    cfg: Any = offloading_config()
    tier = UMBPRedisTier(
        Spec(cfg),  # type: ignore[arg-type]
        view,
        "umbp_redis",
        redis_url=url,
        enable_kv_events=False,  # events are not measured here
    )
    plane = RedisDataPlane(RedisSettings.from_url(url))
    flat = view.cast("B")
    bufs = [flat[i * chunk_bytes : (i + 1) * chunk_bytes] for i in range(2 * n)]
    out: dict[str, list[float]] = {
        k: [] for k in ("tier store", "tier load", "plane store", "plane load")
    }
    total = n * chunk_bytes
    try:
        for r in range(repeats):
            ks = keys(n, seed=r % 250)
            t0 = time.perf_counter()
            tier.submit_store(job(1, ks, list(range(n)), promotion=False))
            assert finish(tier, 1).success
            out["tier store"].append(_gbps(total, time.perf_counter() - t0))
            t0 = time.perf_counter()
            tier.submit_load(job(2, ks, list(range(n, 2 * n)), promotion=True))
            assert finish(tier, 2).success
            out["tier load"].append(_gbps(total, time.perf_counter() - t0))
            pk = block_keys(n, f"plane{r}", "bench")
            t0 = time.perf_counter()
            st = plane.store(list(zip(pk, bufs[:n], strict=True)), FP)
            out["plane store"].append(_gbps(total, time.perf_counter() - t0))
            assert st == [StoreStatus.STORED] * n
            t0 = time.perf_counter()
            ld = plane.load(list(zip(pk, bufs[n:], strict=True)), FP)
            out["plane load"].append(_gbps(total, time.perf_counter() - t0))
            assert ld == [LoadStatus.LOADED] * n
    finally:
        tier.shutdown()
        plane.close()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    with EmbeddedRedis(["--maxmemory", "0"]) as srv:
        print(
            f"{'chunk':>9} | {'tier store':>16} {'plane store':>16} {'ratio':>6} | "
            f"{'tier load':>16} {'plane load':>16} {'ratio':>6}"
        )
        for size in (256 << 10, 2 << 20, 8 << 20):
            res = run(srv.url, size, args.chunks, args.repeats)
            med = {k: statistics.median(v) for k, v in res.items()}

            def cell(k: str) -> str:
                return f"{med[k]:.2f} [{min(res[k]):.2f}-{max(res[k]):.2f}]"  # noqa: B023

            print(
                f"{size >> 10:>6} KiB | {cell('tier store'):>16} {cell('plane store'):>16} "
                f"{med['tier store'] / med['plane store']:>5.2f}x | {cell('tier load'):>16} "
                f"{cell('plane load'):>16} {med['tier load'] / med['plane load']:>5.2f}x"
            )


if __name__ == "__main__":
    main()
