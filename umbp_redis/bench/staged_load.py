"""Loads through staging into an engine's KV cache, as a GPU engine's worker runs them:
copies started as each window of values arrives against one copy after the batch.

The KV cache has vLLM's GPU layout (32 layers of (2, blocks, 16, 8, 128) bf16: K and V
of a block apart), so an object (one block, every layer) is 2 MiB. ``--objects`` blocks
are gathered into pinned staging and stored in a private Redis; then, interleaved, the
same values are loaded three ways and put into other blocks of the cache:

- receive only: ``RedisDataPlane.load`` into staging, no copy (the data plane's rate);
- copy after the batch: the load, then one scatter of every block (before part 1);
- copy per window: the load reports each window of valid values (``on_loaded``) and
  ``ScatterAsLoaded`` launches their copy at once, as the worker does where its copier
  is asynchronous (the CuPy kernel on its own stream), so copying one window overlaps
  receiving the next.

Prints the median GB/s of each and the ratios: per window against receive only (1.00x:
the copies are hidden behind the receive) and against after the batch. Checks that the
destination blocks hold the source blocks' bytes.

On the CPU (``--device cpu``, or ``auto`` without CUDA) the copies are synchronous torch
copies, so the per-window way copies inline in the receiving thread: that runs the
script anywhere, not the overlap. A redis-server must be findable (PATH, or
``UMBP_REDIS_SERVER``).

Usage: PYTHONPATH=. python3 -m umbp_redis.bench.staged_load [--device auto] [--objects 64]
       [--reps 10] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch

from umbp_redis.bench.gpu_copy import build_cache
from umbp_redis.data import BlockIdentityCodec, KVLayoutPlanner, StagingCopyPlan
from umbp_redis.engine.copy.factory import make_block_copier
from umbp_redis.engine.load_scatter import ScatterAsLoaded
from umbp_redis.engine.staging import StagingPool
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import EmbeddedRedis

GB = 1e9
FP = b"\x09" * 16
LAYERS, BLOCK_SIZE, HEADS, HEAD_SIZE = 32, 16, 8, 128


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--objects", type=int, default=64)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    device = args.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    on_cuda = device == "cuda"

    def synced(fn: Callable[[], object]) -> Callable[[], None]:
        def run() -> None:
            fn()
            if on_cuda:
                torch.cuda.synchronize()

        return run

    n = args.objects
    num_blocks = 2 * n + 8
    cfg, caches = build_cache(LAYERS, num_blocks, BLOCK_SIZE, HEADS, HEAD_SIZE, device)
    planner = KVLayoutPlanner(cfg)
    template = planner.range_template(0, planner.register_kv_caches(caches))
    size = template.object_size
    pool = StagingPool(size, n * size, pin_memory=on_cuda)
    copier = make_block_copier("auto", caches, {0: template}, pool, num_blocks)
    perm = torch.randperm(num_blocks).tolist()
    sources, dests = tuple(perm[:n]), tuple(perm[n : 2 * n])
    slots = tuple(range(n))
    copier.gather(StagingCopyPlan((0,) * n, sources, slots)).wait()
    name = torch.cuda.get_device_name() if on_cuda else "CPU"
    print(f"device: {name}, copier {type(copier).__name__}, {n} objects of {size} bytes")

    def to_dests(indices: list[int]) -> StagingCopyPlan:
        return StagingCopyPlan(
            (0,) * len(indices), tuple(dests[i] for i in indices), tuple(indices)
        )

    with EmbeddedRedis() as srv:
        plane = RedisDataPlane(RedisSettings.from_url(srv.url))
        codec = BlockIdentityCodec("bench-staged")
        keys = [codec.key(i.to_bytes(32, "big"), 0) for i in range(n)]
        items = [(k, pool.array(i)[:size]) for i, k in enumerate(keys)]
        assert plane.store(items, FP) == [StoreStatus.STORED] * n

        def load(on_loaded: Callable[[list[int]], None] | None = None) -> None:
            st = plane.load(items, FP, on_loaded=on_loaded)
            assert st == [LoadStatus.LOADED] * n, st

        def after_batch() -> None:
            load()
            copier.scatter(to_dests(list(range(n))), copier.engine_point()).wait()

        launches: list[int] = []

        def per_window() -> None:
            scatters = ScatterAsLoaded(copier, to_dests, copier.engine_point())
            load(scatters.launch)
            scatters.launch(list(range(n)))  # any the plane did not report
            scatters.wait()
            assert not scatters.failed
            launches.append(scatters.launches)

        ways = {
            "receive only": synced(load),
            "copy after the batch": synced(after_batch),
            "copy per window": synced(per_window),
        }
        samples: dict[str, list[float]] = {w: [] for w in ways}
        for fn in ways.values():  # warm-up: kernels loaded, pages touched
            fn()
        for _ in range(args.reps):
            for w, fn in ways.items():
                t0 = time.perf_counter()
                fn()
                samples[w].append(time.perf_counter() - t0)
        plane.delete(keys)
        plane.close()

    for t in caches.values():  # what was timed put every source block's bytes in its dest
        bits = t.view(torch.int16)  # bytes, not values: random bits hold NaNs
        assert torch.equal(bits[:, list(dests)], bits[:, list(sources)]), "bytes differ"
    rates = {w: n * size / statistics.median(s) / GB for w, s in samples.items()}
    for w, r in rates.items():
        print(f"  {w:22s} {r:6.2f} GB/s")
    hidden = rates["copy per window"] / rates["receive only"]
    gain = rates["copy per window"] / rates["copy after the batch"]
    print(
        f"copy per window / receive only {hidden:.2f}x (1.00x: copies hidden), "
        f"/ copy after the batch {gain:.2f}x; {statistics.median(launches):.0f} copies a load"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "object_bytes": size, "objects": n, **rates}, f, indent=2)


if __name__ == "__main__":
    main()
