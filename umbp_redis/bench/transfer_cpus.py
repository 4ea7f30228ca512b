"""What a load in flight costs the forward pass, with the transfer thread on the forward
pass's CPU (``transfer_cpus: inherit``), on the reserved CPUs only (a list), or free to
run on either (``auto``).

Emulates a vLLM CPU worker with one reserved core: this process's OpenMP threads are
bound to the first CPU (``OMP_PLACES``/``OMP_PROC_BIND``, as vLLM's executor sets them,
1 thread), a forward-like torch loop (8 layers of a hidden-1024 Llama: projections,
attention of 56 tokens over 3000, MLP) runs on it, and a transfer thread started by the
bound thread (a ``ThreadPoolExecutor`` with the connector's ``ThreadPinner``, as the
worker's load thread) loads 23 objects of 2 MiB from a private Redis server bound to the
other CPUs, four times in a row, while the forward runs.

Prints, per setting, the forward's time alone and with loads in flight (their ratio:
what the loads cost the engine's step) and the load rate.

Usage: .venv/bin/python -m umbp_redis.bench.transfer_cpus [--reps 7]
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor

from umbp_redis.bench.cpu_worker_emulation import Forward, redis_on, start

OBJECTS, SIZE = 23, 2 << 20


def main() -> None:
    args, forward_cpu, reserved = start(__doc__ or "")
    from umbp_redis.store.plane import LoadStatus, RedisDataPlane
    from umbp_redis.store.settings import RedisSettings
    from umbp_redis.store.thread_affinity import ThreadPinner

    forward = Forward()

    with redis_on(reserved) as url:
        plane = RedisDataPlane(RedisSettings.from_url(url, transfer_connections=1))
        fp = b"\x01" * 16
        payload = bytearray(os.urandom(SIZE))
        keys = [f"bench:cpus:{i}" for i in range(OBJECTS)]
        plane.store([(k, payload) for k in keys], fp)
        dst = [bytearray(SIZE) for _ in range(OBJECTS)]

        def loads() -> float:
            start = time.perf_counter()
            for _ in range(4):
                res = plane.load(list(zip(keys, dst, strict=True)), fp)
                assert all(s is LoadStatus.LOADED for s in res), res
            return 4 * OBJECTS * SIZE / (time.perf_counter() - start) / 1e9

        forward()
        loads()
        med = statistics.median
        print(f"forward pass on CPU {forward_cpu} (1 OpenMP thread), Redis on CPUs {reserved}")
        only_reserved = ",".join(map(str, reserved))  # auto's choice before 2026-12-04 23:50
        for spec in ("inherit", only_reserved, "auto"):
            pinner = ThreadPinner(spec)
            with ThreadPoolExecutor(1, initializer=pinner) as pool:
                where = pool.submit(lambda: sorted(os.sched_getaffinity(0))).result()
                alone, loaded, rates = [], [], []
                for _ in range(args.reps):
                    alone.append(forward())
                    fut = pool.submit(loads)
                    loaded.append(forward())
                    rates.append(fut.result())
            print(
                f"transfer_cpus={spec!r:10s} load thread on CPUs {where}: forward alone "
                f"{med(alone) * 1e3:.0f} ms, with loads in flight {med(loaded) * 1e3:.0f} ms "
                f"({med(loaded) / med(alone):.2f}x); loads {med(rates):.2f} GB/s"
            )
        plane.close()


if __name__ == "__main__":
    main()
