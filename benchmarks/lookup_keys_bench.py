"""Scheduler lookup of a 128k-token prompt: key building plus the Redis round trip.

8,000 blocks (block size 16), every block present in a private redis-server, at TP=1
and TP=8 (8 rank keys a block). In one run, for each:

- ``before``: the lookup as the scheduler did it until this change: every call builds
  every rank key with ``BlockIdentityCodec.key`` (validated, one rank label each), then
  one ``EXPIRE`` per key;
- ``first``: ``UMBPScheduler.get_num_new_matched_tokens`` on a new request (its keys and
  encoded commands built once, from precomputed rank prefixes);
- ``again``: the same request asked again (vLLM asks each step while it waits);
- ``floor``: the same encoded commands written by a bare socket and their replies read
  (Redis' own time for the keys, no client work).

Also with ``refresh_ttl_on_lookup: false`` (one multi-key ``TOUCH`` a block). Prints
p50 ms and ratios. Usage: .venv/bin/python benchmarks/lookup_keys_bench.py
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

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

import redis  # noqa: E402
from kv_fixtures import attn_spec, vllm_layout_caches  # noqa: E402
from test_data_identity import make_vllm_config  # noqa: E402
from vllm.config import ModelConfig  # noqa: E402
from vllm.v1.kv_cache_layout import KVCacheLayout  # noqa: E402

from umbp_redis.engine.options import parse_connector_options  # noqa: E402
from umbp_redis.engine.scheduler import UMBPScheduler  # noqa: E402
from umbp_redis.ops.embedded_redis import EmbeddedRedis  # noqa: E402
from umbp_redis.ops.tiny_model import build_tiny_llama  # noqa: E402
from umbp_redis.store.commands import expire_command  # noqa: E402
from umbp_redis.store.plane import RedisDataPlane  # noqa: E402
from umbp_redis.store.settings import RedisSettings  # noqa: E402

BLOCKS = 8000
BS = 16


@dataclass
class Req:
    request_id: str
    num_prompt_tokens: int
    block_hashes: list[bytes]


def p50_ms(fn: Callable[[], Any], runs: int) -> float:
    fn()
    samples = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def old_lookup(s: UMBPScheduler, plane: RedisDataPlane, hashes: list[bytes]) -> int:
    """The scheduler's lookup before keys were cached (key building + EXPIRE each)."""
    codec = s.codec
    assert codec is not None
    keys: list[str] = []
    per_block = 0
    for h in hashes:
        block_keys = [
            k
            for g in s.groups
            for k in dict.fromkeys(codec.key(h, g, r) for r in codec.topology.rank_namespaces())
        ]
        per_block = len(block_keys)
        keys.extend(block_keys)
    ttl = plane.ttl_arg
    buf = b"".join(expire_command(k.encode(), ttl) for k in keys)
    replies = plane.lookup_replies(buf, len(keys), timeout=30.0)
    assert replies is not None
    hits = 0
    for b in range(len(hashes)):
        if all(replies[b * per_block : (b + 1) * per_block]):
            hits += 1
        else:
            break
    return hits


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


def measure(
    srv: EmbeddedRedis, mc: ModelConfig, kv: Any, hashes: list[bytes], tp: int, refresh: bool
) -> tuple[float, float, float, float]:
    """(before, first, again, floor) p50 ms for one TP size and lookup mode."""
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
    for h in hashes:
        for k in s.codec.rank_keys(h, 0):
            pipe.set(k, b"x")
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

    def before() -> None:
        assert old_lookup(s, plane, hashes) == BLOCKS

    runs = 11
    t_before = p50_ms(before, runs) if refresh else float("nan")
    t_first, t_again = p50_ms(first, runs), p50_ms(again, runs)
    buf = b"".join(s.requests["held"].lookup_cmds)
    n_replies = BLOCKS * (s._keys_per_block if refresh else 1)
    t_floor = floor_ms(srv.port, buf, n_replies, runs)
    s.shutdown()
    plane.close()
    r.flushall()
    r.close()
    return t_before, t_first, t_again, t_floor


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
        "TP | TTL refresh | before | first (keys built) | again (cached) | Redis floor | "
        "before/first | again/floor"
    )
    for tp, refresh, tb, tf, ta, tfl in rows:
        ratio = f"{tb / tf:6.1f}x" if refresh else "     -"
        print(
            f"{tp:2} | {'EXPIRE' if refresh else 'TOUCH ':>11} | {tb:6.1f} | {tf:18.1f} | "
            f"{ta:14.1f} | {tfl:11.1f} | {ratio} | {ta / tfl:5.2f}x"
        )


if __name__ == "__main__":
    main()
