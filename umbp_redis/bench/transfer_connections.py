"""Store and load GB/s of the data plane on 1 and on 2 transfer connections, interleaved.

The default ``transfer_connections: auto`` takes 1 connection where fewer than 4 CPUs
are usable (the machine's, or its container's cgroup limit) and 2 from 4 on. This
script shows the choice on the machine it runs on: one private server, both settings
alternating, each size's median of ``--repeats``.

Usage: .venv/bin/python -m umbp_redis.bench.transfer_connections [--repeats 5]
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics

SIZES = ((65536, 2048), (524288, 256), (2097152, 64))  # 128 MiB each


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from umbp_redis.bench.dataplane import umbp_gbps
    from umbp_redis.store.plane import RedisDataPlane
    from umbp_redis.store.settings import RedisSettings
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    with EmbeddedRedis() as srv:
        base = RedisSettings.from_url(srv.url)
        planes = {
            n: RedisDataPlane(dataclasses.replace(base, transfer_connections=n)) for n in (1, 2)
        }
        print(f"default here (auto): {base.transfer_connections} connection(s)")
        print("value size x count | connections | store GB/s | load GB/s (medians)")
        for size, count in SIZES:
            runs: dict[int, list[dict[str, float]]] = {n: [] for n in planes}
            for _ in range(args.repeats):
                for n, plane in planes.items():
                    runs[n].append(umbp_gbps(plane, size, count, 1))
            for n in planes:
                store = statistics.median(r["store"] for r in runs[n])
                load = statistics.median(r["load"] for r in runs[n])
                print(f"{size:>10} x {count:<5} | {n:>11} | {store:10.2f} | {load:9.2f}")


if __name__ == "__main__":
    main()
