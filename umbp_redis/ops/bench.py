"""``umbp-redis bench``: benchmarks that print ratios against baselines of the same run."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def register(sub: Any) -> None:
    """Add the ``bench`` subcommand and its targets to the CLI."""
    p = sub.add_parser("bench", help="run a benchmark")
    targets = p.add_subparsers(dest="bench_target", metavar="TARGET")
    plane = targets.add_parser(
        "dataplane",
        help="store/load GB/s and lookup latency vs redis-benchmark and plain redis-py",
    )
    plane.add_argument(
        "--redis-url",
        default=None,
        help="server to measure (default: a private server started for the run); the "
        "benchmark writes and deletes only keys of its own run",
    )
    plane.add_argument("--json", action="store_true", help="print one JSON object")
    plane.add_argument(
        "--sizes", default="65536,524288,2097152", help="comma-separated value sizes in bytes"
    )
    plane.add_argument(
        "--total-mib", type=int, default=256, help="payload MiB moved per measurement (default 256)"
    )
    plane.add_argument("--repeats", type=int, default=3, help="runs per measurement; best is kept")
    plane.set_defaults(handler=_run_dataplane)
    cl = targets.add_parser(
        "cluster",
        help="store/load GB/s and lookup p50: 1 node vs 3 masters, each behind a "
        "rate-limited link in its own network namespace (needs root)",
    )
    cl.add_argument("--json", action="store_true", help="print one JSON object")
    cl.add_argument(
        "--rate-mbit", type=int, default=1600, help="link rate per node, each way (default 1600)"
    )
    cl.add_argument("--total-mib", type=int, default=192, help="MiB moved per measurement")
    cl.add_argument("--repeats", type=int, default=3, help="interleaved rounds; best is kept")
    cl.set_defaults(handler=_run_cluster)
    p.set_defaults(handler=lambda a: (p.print_help(), 0)[1])


def _run_dataplane(args: argparse.Namespace) -> int:
    from umbp_redis.ops.bench_dataplane import format_table, run_dataplane_bench
    from umbp_redis.ops.embedded_redis import EmbeddedRedis

    url = args.redis_url
    sizes = [int(s) for s in args.sizes.split(",") if s]
    server = None
    if not url:
        server = EmbeddedRedis().start()
        url = server.url
    try:
        result = run_dataplane_bench(
            url,
            sizes=sizes,
            total_bytes=args.total_mib << 20,
            repeats=args.repeats,
            progress=None if args.json else sys.stderr,
        )
    finally:
        if server is not None:
            server.cleanup()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_table(result))
    return 0


def _run_cluster(args: argparse.Namespace) -> int:
    from umbp_redis.ops.bench_cluster import (
        NetworkSetupError,
        format_cluster_table,
        run_cluster_bench,
    )

    try:
        result = run_cluster_bench(
            rate_mbit=args.rate_mbit,
            total_mib=args.total_mib,
            repeats=args.repeats,
            progress=None if args.json else sys.stderr,
        )
    except NetworkSetupError as e:
        print(f"umbp-redis bench cluster: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(format_cluster_table(result))
    return 0
