"""Scheduler lookup of a 128k-token prompt: key building plus the Redis round trip.

8,000 blocks (block size 16), every block present in a private redis-server (every
rank's value and the block's stored marker), at TP=1 and TP=8. In one run, for each:

- ``rank keys (v1 floor)``: what key schema v1 asked of Redis, every rank's value key
  of every block (8 keys a block at TP=8), written by a bare socket: Redis' own time
  for them, the least a per-rank lookup could cost;
- ``first``: ``UMBPScheduler.get_num_new_matched_tokens`` on a new request (one stored
  marker a block; keys and encoded commands built once per block), with the marker
  writer's value refreshes running beside it as in an engine;
- ``again``: the same request asked again (vLLM asks each step while it waits);
- ``floor``: the marker commands written by a bare socket and their replies read.

Also with ``refresh_ttl_on_lookup: false`` (``TOUCH``). Prints p50 ms, ratios against
the floor and TP=8 against TP=1. Usage: .venv/bin/python -m umbp_redis.bench.lookup_keys
"""

from __future__ import annotations

import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]  # the checkout: this benchmark uses the tests' fixtures
sys.path.insert(0, str(ROOT / "tests"))

import redis  # noqa: E402
from kv_fixtures import attn_spec, vllm_layout_caches  # noqa: E402
from test_data_identity import make_vllm_config  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402
from vllm.v1.request import RequestStatus  # noqa: E402

from umbp_redis.engine.options import parse_connector_options  # noqa: E402
from umbp_redis.engine.scheduler import UMBPScheduler  # noqa: E402
from umbp_redis.store.commands import lookup_commands, ttl_argument  # noqa: E402
from umbp_redis.store.plane import RedisDataPlane  # noqa: E402
from umbp_redis.store.settings import RedisSettings  # noqa: E402
from umbp_redis.testing.embedded_redis import EmbeddedRedis  # noqa: E402
from umbp_redis.testing.tiny_model import build_tiny_llama  # noqa: E402

BLOCKS = 8000
BS = 16


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]
    status: RequestStatus = RequestStatus.RUNNING


def p50_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def floor_ms(port: int, buf: bytes, replies: int, runs: int) -> float:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def once() -> None:
        sock.sendall(buf)
        seen = 0
        while seen < replies:
            seen += sock.recv(1 << 22).count(b"\n")

    out = p50_ms(once, runs)
    sock.close()
    return out


def rank_keys_buffer(s: UMBPScheduler, hashes: list[bytes], ttl: bytes, refresh: bool) -> bytes:
    """Key schema v1's lookup: every rank's value key of every block (EXPIRE each, or
    one TOUCH of a block's keys)."""
    assert s.codec is not None
    blocks = [[k.encode() for k in s.codec.rank_keys(h, 0)] for h in hashes]
    return b"".join(lookup_commands(keys, refresh_ttl=refresh, ttl=ttl)[0] for keys in blocks)


def measure(
    srv: EmbeddedRedis, mc: ModelConfig, kv: Any, hashes: list[bytes], tp: int, refresh: bool
) -> tuple[float, float, float, float]:
    """(rank-key floor, first, again, floor) p50 ms for one TP size and lookup mode."""
    extra = {"key_namespace": "bench", "refresh_ttl_on_lookup": refresh, "lookup_timeout_s": 30.0}
    cfg = make_vllm_config(mc, extra=extra)
    # Set after validation: the tiny model's 2 heads do not divide by 8, and only the
    # key layout (8 rank keys a block) matters here.
    cfg.parallel_config.tensor_parallel_size = tp
    plane = RedisDataPlane(RedisSettings.from_url(srv.url, lookup_timeout_s=30.0))
    s = UMBPScheduler(cfg, kv, *parse_connector_options(extra), plane=plane)
    assert s.codec is not None
    r = redis.Redis(port=srv.port)
    pipe = r.pipeline(transaction=False)
    for h in hashes:  # every rank's value and the block's stored marker
        for k in s.codec.rank_keys(h, 0):
            pipe.set(k, b"x")
        pipe.set(s.codec.marker_prefix(0) + h.hex(), b"1")
    pipe.execute()
    n_tok = BLOCKS * BS + 1
    count = iter(range(10**9))

    def first() -> None:
        req = Req(f"r{next(count)}", n_tok, hashes)
        assert s.get_num_new_matched_tokens(req, 0)[0] == BLOCKS * BS  # type: ignore[arg-type]
        s.request_finished(req)  # type: ignore[arg-type]

    held = Req("held", n_tok, hashes)

    def again() -> None:
        assert s.get_num_new_matched_tokens(held, 0)[0] == BLOCKS * BS  # type: ignore[arg-type]

    runs = 11
    t_first, t_again = p50_ms(first, runs), p50_ms(again, runs)
    assert s.markers.flush(30) and s.markers.stale == 0  # values refreshed, none gone
    buf = b"".join(s.requests["held"].lookup_cmds)
    t_floor = floor_ms(srv.port, buf, BLOCKS, runs)
    ttl = ttl_argument(plane.settings.ttl_seconds)
    per_rank = rank_keys_buffer(s, hashes, ttl, refresh)
    t_ranks = floor_ms(srv.port, per_rank, BLOCKS * (tp if refresh else 1), runs)
    s.shutdown()
    plane.close()
    r.flushall()
    r.close()
    return t_ranks, t_first, t_again, t_floor


def main() -> None:
    model = build_tiny_llama(ROOT / ".umbp-test-cache" / "tiny-llama")
    mc = ModelConfig(model=str(model), dtype="bfloat16", max_model_len=1024)
    kv, _ = vllm_layout_caches(KVCacheLayout.LBHNC, num_blocks=32, spec=attn_spec(block_size=BS))
    hashes = [i.to_bytes(32, "big") for i in range(BLOCKS)]
    with EmbeddedRedis() as srv:
        rows = [
            (tp, refresh, *measure(srv, mc, kv, hashes, tp, refresh))
            for tp in (1, 8)
            for refresh in (True, False)
        ]
    print(f"lookup of {BLOCKS} blocks (block size {BS}), every block present; p50 ms")
    print(
        "TP | TTL refresh | rank keys (v1 floor) | first (keys built) | again (cached) | "
        "Redis floor | again/floor"
    )
    for tp, refresh, tr, tf, ta, tfl in rows:
        print(
            f"{tp:2} | {'EXPIRE' if refresh else 'TOUCH ':>11} | {tr:20.1f} | {tf:18.1f} | "
            f"{ta:14.1f} | {tfl:11.1f} | {ta / tfl:5.2f}x"
        )
    by = {(tp, refresh): (tf, ta) for tp, refresh, _, tf, ta, _ in rows}
    for refresh in (True, False):
        (f1, a1), (f8, a8) = by[(1, refresh)], by[(8, refresh)]
        mode = "EXPIRE" if refresh else "TOUCH"
        print(f"{mode}: TP=8 / TP=1: first {f8 / f1:.2f}x, again {a8 / a1:.2f}x")


if __name__ == "__main__":
    main()
