"""Projection for layer-by-layer loads: what a warm prompt's remaining
prefill costs when its prefix is loaded before the forward pass, against loaded layer by
layer while the forward runs, against not loaded at all (vLLM's local prefix cache).

A vLLM CPU worker with one reserved core is emulated (``cpu_worker_emulation``): the
forward-like loop (8 layers, 56 new tokens over 3000) on the first CPU with 1 bound
OpenMP thread; Redis and the transfer thread on the reserved CPU. The prefix is 23 blocks
x 8 layers x 256 KiB (the 46 MB of ``bench/warm_ttft.py``), stored as a hash per block
with one field per layer; both load variants read the same fields with redis-py
pipelines, one per layer (23 ``HGET``):

- ``load then forward``: every layer, then the forward (today's loads, which read whole
  objects, are of this shape);
- ``layered``: a transfer thread reads layer j while the forward computes layer j - 1;
  layer j's computation waits for its fields.

Prints medians of each and their ratio to the forward alone (the local prefix cache).

Usage: .venv/bin/python -m umbp_redis.bench.layered_load_projection [--reps 7]
"""

from __future__ import annotations

import os
import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

from umbp_redis.bench.cpu_worker_emulation import LAYERS, Forward, redis_on, start

BLOCKS, PART = 23, 256 << 10


def main() -> None:
    args, forward_cpu, reserved = start(__doc__ or "")
    import redis

    forward = Forward()
    dst = [[bytearray(PART) for _ in range(LAYERS)] for _ in range(BLOCKS)]

    with redis_on(reserved) as url:
        r = redis.Redis.from_url(url)
        blob = os.urandom(PART)
        for i in range(BLOCKS):
            r.hset(f"bench:layered:{i}", mapping={f"l{j}": blob for j in range(LAYERS)})

        def load_layer(conn: Any, j: int) -> None:
            pipe = conn.pipeline(transaction=False)
            for i in range(BLOCKS):
                pipe.hget(f"bench:layered:{i}", f"l{j}")
            for i, value in enumerate(pipe.execute()):
                assert value is not None and len(value) == PART
                dst[i][j][:] = value

        def load_then_forward() -> None:
            for j in range(LAYERS):
                load_layer(r, j)
            forward()

        transfer = redis.Redis.from_url(url)

        def layered() -> None:
            ready = [threading.Event() for _ in range(LAYERS)]

            def load_all() -> None:
                os.sched_setaffinity(0, reserved)  # as transfer_cpus: auto
                for j in range(LAYERS):
                    load_layer(transfer, j)
                    ready[j].set()

            th = threading.Thread(target=load_all)
            th.start()
            forward(ready)
            th.join()

        def timed(fn: Callable[[], Any]) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start

        def all_layers(r: Any) -> None:
            for j in range(LAYERS):
                load_layer(r, j)

        for fn in (forward, load_then_forward, layered):
            fn()
        runs: dict[str, list[float]] = {"forward": [], "load": [], "then": [], "layered": []}
        for _ in range(args.reps):
            runs["forward"].append(timed(forward))
            runs["then"].append(timed(load_then_forward))
            runs["layered"].append(timed(layered))
            runs["load"].append(timed(lambda: all_layers(r)))
        ms = {k: statistics.median(v) * 1e3 for k, v in runs.items()}
        print(f"forward on CPU {forward_cpu} (1 OpenMP thread), Redis on CPUs {reserved}")
        print(
            f"forward alone {ms['forward']:.0f} ms; load alone {ms['load']:.0f} ms; "
            f"load then forward {ms['then']:.0f} ms ({ms['then'] / ms['forward']:.2f}x); "
            f"layered {ms['layered']:.0f} ms ({ms['layered'] / ms['forward']:.2f}x)"
        )


if __name__ == "__main__":
    main()
