"""The ``umbp-redis`` command line: inspect and tune the Redis KV cache."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from umbp_redis import __version__

Handler = Callable[[argparse.Namespace], int]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser with every subcommand registered."""
    parser = argparse.ArgumentParser(
        prog="umbp-redis",
        description="Redis-backed KV-cache object store for vLLM: inspect, tune, benchmark.",
    )
    parser.add_argument("--version", action="version", version=f"umbp-redis {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from umbp_redis.cli import admin, bench, demo, lookup

    admin.register(sub)
    lookup.register(sub)
    demo.register(sub)
    bench.register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the console script; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help()
        return 0
    from umbp_redis.store.errors import ConfigError

    try:
        return handler(args)
    except ConfigError as e:
        print(f"umbp-redis: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
