"""The fleet's block announcements: what they cost Redis, and how fast they reach the
other engines.

A private redis-server and N ``FleetBlockFeed``s in this process (one per simulated
engine, each with its own data plane and thread, as each engine has) on one namespace.
Every engine announces ``--blocks`` blocks of 128 token ids (the CPU block size), in
store events of ``--per-event`` blocks, as fast as it can or at ``--rate`` blocks/s; each
block's stored marker is written first, as the scheduler does. Measured:

- Redis memory per stream entry (``MEMORY USAGE`` of the stream over its length) and
  beside it the value of one block of a model (``--block-bytes``, default: SmolLM2-135M's
  block of 128 tokens in bf16, 2.95 MB): the announcement's share of what it announces;
- Redis CPU per announced block (``used_cpu_sys`` + ``used_cpu_user`` over the run,
  appends, reads and marker checks together) against a baseline of the markers' SETs;
- relayed events per second per engine, and the delay from an announcement to the last
  other engine's event for it (p50, p99);
- the scheduler thread's share: microseconds per block announced or event taken, in
  ``announce_stored`` and ``take`` (all the feed does on that thread).

Usage: .venv/bin/python -m umbp_redis.bench.fleet_announce [--engines 2,4,8] [--blocks N]
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from typing import Any

import redis
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from umbp_redis.data import BlockIdentityCodec
from umbp_redis.data.announcements import announcement_key
from umbp_redis.engine.fleet_blocks import FleetBlockFeed
from umbp_redis.engine.kv_events import EventBlock, GroupSpecInfo
from umbp_redis.store.plane import RedisDataPlane
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import EmbeddedRedis

BLOCK_TOKENS = 128
# SmolLM2-135M: 30 layers x (K and V) x 3 KV heads x 64 dims x 128 tokens x 2 bytes.
SMOLLM2_BLOCK_BYTES = 30 * 2 * 3 * 64 * BLOCK_TOKENS * 2


def _cpu_s(r: Any) -> float:
    info = r.info("cpu")
    return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])


def run(engines: int, blocks: int, per_event: int, rate: float) -> dict[str, float]:
    """One run with ``engines`` feeds, each announcing ``blocks`` blocks."""
    codec = BlockIdentityCodec("annbench")
    specs = {0: GroupSpecInfo("full_attention", None)}
    with EmbeddedRedis() as server:
        r = redis.Redis.from_url(server.url)
        planes = [RedisDataPlane(RedisSettings.from_url(server.url)) for _ in range(engines)]
        feeds = [
            FleetBlockFeed(p, codec, f"e{i}", BLOCK_TOKENS, specs, ttl_s=3600, timeout_s=5.0)
            for i, p in enumerate(planes)
        ]
        for f in feeds:
            f.start()
        while not all(f.caught_up for f in feeds):
            time.sleep(0.01)  # polls a condition; the feeds read an empty stream first
        sent_at: dict[Any, float] = {}
        seen: dict[Any, int] = {}
        last_seen: dict[Any, float] = {}
        done = threading.Event()

        def drain() -> None:
            while not done.is_set():
                now = time.perf_counter()
                for f in feeds:
                    t = time.perf_counter()
                    taken = f.take()
                    hook_s[0] += time.perf_counter() - t
                    events_taken[0] += len(taken)
                    for e in taken:
                        for h in e.block_hashes:
                            seen[h] = seen.get(h, 0) + 1
                            last_seen[h] = now
                time.sleep(0.005)

        # Time the scheduler thread spends in the feed: queuing announcements, taking events.
        hook_s = [0.0]
        events_taken = [0]

        drainer = threading.Thread(target=drain, daemon=True)
        drainer.start()
        cpu0 = _cpu_s(r)
        t0 = time.perf_counter()

        def announce(i: int) -> None:
            for start in range(0, blocks, per_event):
                batch = []
                for j in range(start, min(start + per_event, blocks)):
                    h = b"\x00" * 24 + i.to_bytes(4, "little") + j.to_bytes(4, "little")
                    r.set(codec.marker_key(h, 0), b"1", ex=3600)
                    tokens = tuple((i * 7919 + j * 131 + k) % 50000 for k in range(BLOCK_TOKENS))
                    batch.append(EventBlock(h, None, tokens, 0))
                    sent_at[maybe_convert_block_hash(h)] = time.perf_counter()  # type: ignore[arg-type]
                t = time.perf_counter()
                feeds[i].announce_stored(batch)
                hook_s[0] += time.perf_counter() - t
                if rate > 0:
                    time.sleep(len(batch) / rate)

        writers = [threading.Thread(target=announce, args=(i,)) for i in range(engines)]
        for w in writers:
            w.start()
        for w in writers:
            w.join()
        total = engines * blocks
        deadline = time.monotonic() + 120
        while sum(1 for n in seen.values() if n >= engines - 1) < total:
            if time.monotonic() > deadline:
                break
            time.sleep(0.01)
        wall = time.perf_counter() - t0
        done.set()
        cpu = _cpu_s(r) - cpu0
        key = announcement_key("annbench")
        length = int(r.xlen(key))
        mem = int(r.memory_usage(key, samples=0) or 0)
        delays = sorted(last_seen[h] - sent_at[h] for h in sent_at if h in last_seen)
        # Baseline: the markers' SETs alone, the same number of commands.
        cpu1 = _cpu_s(r)
        pipe = r.pipeline(transaction=False)
        for n in range(total):
            pipe.set(codec.marker_key(b"base" + n.to_bytes(28, "big"), 0), b"1", ex=3600)
            if n % 1000 == 999:
                pipe.execute()
        pipe.execute()
        base_cpu = _cpu_s(r) - cpu1
        for f in feeds:
            f.close()
        for p in planes:
            p.close()
        r.close()
    return {
        "engines": engines,
        "blocks": total,
        "relayed_fully": sum(1 for n in seen.values() if n >= engines - 1),
        "wall_s": wall,
        "bytes_per_entry": mem / max(length, 1),
        "cpu_us_per_block": 1e6 * cpu / total,
        "set_cpu_us_per_block": 1e6 * base_cpu / total,
        "events_per_s_per_engine": total * (engines - 1) / engines / wall,
        "hook_us_per_block": 1e6 * hook_s[0] / (total + events_taken[0]),
        "delay_p50_ms": 1e3 * statistics.median(delays) if delays else float("nan"),
        "delay_p99_ms": 1e3 * delays[int(0.99 * (len(delays) - 1))] if delays else float("nan"),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engines", default="2,4,8", help="engine counts, comma-separated")
    ap.add_argument("--blocks", type=int, default=5000, help="blocks each engine announces")
    ap.add_argument("--per-event", type=int, default=8, help="blocks per store event")
    ap.add_argument("--rate", type=float, default=0.0, help="blocks/s per engine (0: flat out)")
    ap.add_argument("--block-bytes", type=int, default=SMOLLM2_BLOCK_BYTES)
    args = ap.parse_args()
    print(
        "engines  blocks  relayed  B/entry  share-of-block  redis-us/block  (SET alone)"
        "  events/s/engine  delay-p50-ms  delay-p99-ms  scheduler-us/block"
    )
    for n in (int(x) for x in args.engines.split(",")):
        res = run(n, args.blocks, args.per_event, args.rate)
        share = res["bytes_per_entry"] / args.block_bytes
        print(
            f"{n:7d}  {res['blocks']:6d}  {res['relayed_fully']:7d}  "
            f"{res['bytes_per_entry']:7.0f}  {100 * share:13.3f}%  "
            f"{res['cpu_us_per_block']:14.1f}  {res['set_cpu_us_per_block']:11.1f}  "
            f"{res['events_per_s_per_engine']:15.0f}  {res['delay_p50_ms']:12.1f}  "
            f"{res['delay_p99_ms']:12.1f}  {res['hook_us_per_block']:18.2f}"
        )


if __name__ == "__main__":
    main()
