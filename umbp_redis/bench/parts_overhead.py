"""What storing objects in parts (value format 3) costs the data plane's whole loads.

The warm engine's objects (2 MiB: 8 layers of 256 KiB) are stored twice on a private
Redis: whole (version 2: fields ``h`` and ``b``) and in 8 parts (version 3: ``h``,
``b`` ... ``b7``). Then, interleaved, ``RedisDataPlane.load`` reads a batch of them
whole from each, and a third way a part of every object at a time (``on_part``, as a
load by layer does). Prints the median GB/s of each and their ratios to the whole
version 2 loads.

Usage: .venv/bin/python -m umbp_redis.bench.parts_overhead [--objects 23] [--reps 15]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import EmbeddedRedis

FP = b"\x05" * 16
PART, LAYERS = 256 << 10, 8


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--objects", type=int, default=23)
    ap.add_argument("--reps", type=int, default=15)
    args = ap.parse_args()
    n, size = args.objects, PART * LAYERS
    parts = (PART,) * LAYERS
    data = np.random.default_rng(1).integers(0, 256, (n, size), dtype=np.uint8)
    dest = np.zeros_like(data)
    with EmbeddedRedis() as srv:
        plane = RedisDataPlane(RedisSettings.from_url(srv.url, checksum=True))
        whole_keys = [f"bench:whole:{i}" for i in range(n)]
        part_keys = [f"bench:parts:{i}" for i in range(n)]
        assert plane.store(list(zip(whole_keys, data, strict=True)), FP) == [StoreStatus.STORED] * n
        assert (
            plane.store(list(zip(part_keys, data, strict=True)), FP, parts=parts)
            == [StoreStatus.STORED] * n
        )

        def whole_v2() -> None:
            items = [(k, memoryview(dest[i])) for i, k in enumerate(whole_keys)]
            assert plane.load(items, FP) == [LoadStatus.LOADED] * n

        def whole_v3() -> None:
            items = [(k, memoryview(dest[i])) for i, k in enumerate(part_keys)]
            assert plane.load(items, FP, parts=parts) == [LoadStatus.LOADED] * n

        def by_part() -> None:
            items = [(k, memoryview(dest[i])) for i, k in enumerate(part_keys)]
            st = plane.load(items, FP, parts=parts, on_part=lambda p, done: None)
            assert st == [LoadStatus.LOADED] * n

        ways = {"whole, v2": whole_v2, "whole, v3 (8 parts)": whole_v3, "by part": by_part}
        times: dict[str, list[float]] = {name: [] for name in ways}
        for f in ways.values():
            f()  # connections made, pages touched
        for _ in range(args.reps):
            for name, f in ways.items():
                t0 = time.perf_counter()
                f()
                times[name].append(time.perf_counter() - t0)
        assert np.array_equal(dest, data)
        plane.close()
    base = statistics.median(times["whole, v2"])
    print(f"{n} objects of {size >> 20} MiB, {args.reps} interleaved repetitions")
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"  {name:22s} {n * size / med / 1e9:5.2f} GB/s  {base / med:5.2f}x of whole v2")


if __name__ == "__main__":
    main()
