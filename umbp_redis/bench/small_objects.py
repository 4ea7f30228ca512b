"""Store and load of small objects against redis-benchmark with the same key pattern.

``umbp-redis bench dataplane`` compares with ``redis-benchmark -t set,get`` on ONE key:
every SET replaces the same value (the server reuses its memory) and every GET sends the
same 64 KiB, warm in the CPU caches. This client writes and reads many keys. This
script measures, in one run against one private server, interleaved (best of
``--repeats``):

* redis-benchmark SET/GET on one key (the dataplane bench's baseline), on a keyspace of
  as many keys as this client moves (``-r COUNT``: values the server must find in
  memory), and SET on fresh keys (COUNT requests over a keyspace of 10**8 on an emptied
  server, as this client's fresh store: the server allocates new memory; redis-benchmark
  takes ``-r`` as a C int, and ``-r 2**40`` silently wrote ONE key, so the script checks
  ``DBSIZE`` after the run);
* this client's store on fresh keys (deleted before each run), its store over existing
  keys, and its load, with each ``max_inflight_bytes`` given;
* the ceiling of any Python client on one connection: the same ``HMGET`` replies
  received with the load's pipelining (1 MiB in flight, half of it sent before the
  previous half is read) into one scratch buffer, with no parsing, validation or
  checksum (``bare receive``).

Prints GB/s (and, for this client, the least CPU time it used per object, all its
threads; for this client and redis-benchmark over as many keys, the least CPU time the
server used per object, from ``INFO cpu``), the server's time a call of the commands
each ran (``INFO commandstats``: ``HSET`` inside a store's transaction against
``SET``) and each figure over its like-for-like redis-benchmark baseline.

Usage: .venv/bin/python -m umbp_redis.bench.small_objects [--size 65536] [--repeats 4]
       [--inflight 4194304,1048576]
"""

from __future__ import annotations

import argparse
import dataclasses
import shutil
import socket
import subprocess
import time

import numpy as np
import redis

RB_REQUESTS = 20000  # requests of each redis-benchmark test but the fresh-key SET


def redis_benchmark(
    port: int, size: int, keyspace: int | None, tests: str, requests: int = RB_REQUESTS
) -> dict[str, float]:
    """GB/s of redis-benchmark (4 clients, pipeline 4) for ``tests`` (e.g. "set,get")."""
    exe = shutil.which("redis-benchmark")
    if exe is None:
        return {}
    args = [exe, "-p", str(port), "-c", "4", "-P", "4", "-d", str(size), "-n", str(requests)]
    args += ["-r", str(keyspace)] if keyspace else []
    out = subprocess.run(
        [*args, "-t", tests, "--csv"], capture_output=True, text=True, timeout=600
    ).stdout
    rates = {}
    for line in out.splitlines()[1:]:
        cols = [c.strip('"') for c in line.split(",")]
        rates[cols[0].lower()] = float(cols[1]) * size / 1e9
    return rates


def bare_receive(port: int, keys: list[str], inflight: int) -> float:
    """Seconds to fetch every key's ``HMGET key h b`` reply on one connection, sent in
    windows of ``inflight // 2`` bytes with one window sent ahead (as the data plane
    does), each reply received unparsed into one scratch buffer (every value being the
    size of the first key's)."""
    h, b = redis.Redis(port=port).hmget(keys[0], ["h", "b"])  # every value is this size
    assert h is not None and b is not None
    sizes = [sum(len(b"$%d\r\n" % len(f)) + len(f) + 2 for f in (h, b)) + 4] * len(keys)
    cmds = [
        b"*4\r\n$5\r\nHMGET\r\n$%d\r\n%s\r\n$1\r\nh\r\n$1\r\nb\r\n" % (len(k), k.encode())
        for k in keys
    ]
    from umbp_redis.store.plane import _byte_windows  # the data plane's own windows

    groups = _byte_windows(sizes, inflight // 2)
    scratch = memoryview(bytearray(max(sum(sizes[i] for i in g) for g in groups)))
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def read(g: range) -> None:
            need, got = sum(sizes[i] for i in g), 0
            while got < need:
                got += sock.recv_into(scratch[got:need])

        t0 = time.perf_counter()
        pending: list[range] = []
        for g in groups:
            sock.sendall(b"".join(cmds[i] for i in g))
            pending.append(g)
            if len(pending) > 1:
                read(pending.pop(0))
        for g in pending:
            read(g)
        return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=65536)
    ap.add_argument("--total-mib", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=4)
    ap.add_argument("--inflight", default="4194304,1048576", help="max_inflight_bytes values")
    args = ap.parse_args()
    from umbp_redis.bench.dataplane import FINGERPRINT, FRESH_KEYSPACE
    from umbp_redis.data import BlockIdentityCodec
    from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
    from umbp_redis.store.settings import RedisSettings
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    size, count = args.size, (args.total_mib << 20) // args.size
    inflight = [int(x) for x in args.inflight.split(",")]
    best: dict[str, float] = {}

    cpu: dict[str, float] = {}  # least client CPU (all threads) per object, us
    server: dict[str, float] = {}  # least server CPU per object (INFO cpu), us
    per_call: dict[str, float] = {}  # least server time a command (INFO commandstats), us

    def keep(
        name: str,
        value: float,
        cpu_s: float | None = None,
        server_s: float | None = None,
        objects: int = count,
    ) -> None:
        best[name] = max(best.get(name, 0.0), value)
        if cpu_s is not None:
            cpu[name] = min(cpu.get(name, float("inf")), cpu_s / objects * 1e6)
        if server_s is not None:
            server[name] = min(server.get(name, float("inf")), server_s / objects * 1e6)

    with EmbeddedRedis() as srv:
        base = RedisSettings.from_url(srv.url)
        planes = {
            w: RedisDataPlane(dataclasses.replace(base, max_inflight_bytes=w)) for w in inflight
        }
        staging = np.random.default_rng(2).integers(0, 256, (count, size), dtype=np.uint8)
        dest = np.zeros_like(staging)
        codec = BlockIdentityCodec("small")
        keys = [codec.key(i.to_bytes(32, "big"), 0) for i in range(count)]
        stores = list(zip(keys, staging, strict=True))
        loads = [(k, memoryview(dest[i])) for i, k in enumerate(keys)]
        admin = redis.Redis.from_url(srv.url)

        def server_cpu() -> float:
            info = admin.info("cpu")
            return float(info["used_cpu_sys"]) + float(info["used_cpu_user"])

        def keep_per_call(what: str) -> None:
            """The server's time a call of each command since the last ``reset_stat``."""
            for name, stat in admin.info("commandstats").items():
                command = name.removeprefix("cmdstat_").upper()
                if command in ("SET", "GET", "HSET", "EXEC", "HMGET"):
                    label = f"{command} ({what})"
                    per_call[label] = min(per_call.get(label, float("inf")), stat["usec_per_call"])

        for _ in range(args.repeats):
            admin.flushall()  # this run's private server
            fresh = redis_benchmark(srv.port, size, FRESH_KEYSPACE, "set", count)
            written = admin.dbsize()
            if fresh and written < count * 0.9:
                raise RuntimeError(f"redis-benchmark wrote {written} keys, not ~{count}")
            for test, v in fresh.items():
                keep(f"redis-benchmark {test.upper()} fresh keys", v)
            admin.flushall()
            for test, v in redis_benchmark(srv.port, size, None, "set,get").items():
                keep(f"redis-benchmark {test.upper()} one key", v)
            for test in ("set", "get"):  # one at a time, to count the server's CPU of each
                admin.config_resetstat()
                s0 = server_cpu()
                for t, v in redis_benchmark(srv.port, size, count, test).items():
                    keep(
                        f"redis-benchmark {t.upper()} {count} keys",
                        v,
                        server_s=server_cpu() - s0,
                        objects=RB_REQUESTS,
                    )
                keep_per_call(f"redis-benchmark, {count} keys")
            admin.flushall()
            for w, plane in planes.items():
                for phase in ("fresh", "existing"):
                    admin.config_resetstat()
                    s0, c0, t0 = server_cpu(), time.process_time(), time.perf_counter()
                    st = plane.store(stores, FINGERPRINT)
                    dt, dc = time.perf_counter() - t0, time.process_time() - c0
                    assert all(s is StoreStatus.STORED for s in st)
                    keep(
                        f"umbp store {phase} keys, inflight {w >> 10} KiB",
                        count * size / dt / 1e9,
                        dc,
                        server_cpu() - s0,
                    )
                    keep_per_call(f"umbp store of {phase} keys")
                admin.config_resetstat()
                s0, c0, t0 = server_cpu(), time.process_time(), time.perf_counter()
                lt = plane.load(loads, FINGERPRINT)
                dt, dc = time.perf_counter() - t0, time.process_time() - c0
                ds = server_cpu() - s0
                assert all(s is LoadStatus.LOADED for s in lt) and np.array_equal(dest, staging)
                keep(f"umbp load, inflight {w >> 10} KiB", count * size / dt / 1e9, dc, ds)
                keep_per_call("umbp load")
                if w == 1 << 20:
                    bare = bare_receive(srv.port, keys, w)
                    keep("bare receive (Python, 1 conn, 1 MiB)", count * size / bare / 1e9)
                plane.delete(keys)
    print(f"{count} objects of {size} bytes, best of {args.repeats} (GB/s)")
    for name, v in best.items():
        used = f"   client CPU {cpu[name]:5.1f} us/object" if name in cpu else ""
        used += f"   server CPU {server[name]:5.1f} us/object" if name in server else ""
        print(f"  {name:45s} {v:6.2f}{used}")
    print("server time a command (INFO commandstats, least over runs), us:")
    for label, usec in sorted(per_call.items()):
        print(f"  {label:45s} {usec:6.2f}")
    one_set, one_get = (
        best.get("redis-benchmark SET one key"),
        best.get("redis-benchmark GET one key"),
    )
    many_set = best.get(f"redis-benchmark SET {count} keys")
    many_get = best.get(f"redis-benchmark GET {count} keys")
    fresh_set = best.get("redis-benchmark SET fresh keys")
    for w in inflight:
        kib = w >> 10
        sf = best[f"umbp store fresh keys, inflight {kib} KiB"]
        se = best[f"umbp store existing keys, inflight {kib} KiB"]
        ld = best[f"umbp load, inflight {kib} KiB"]
        if one_set and one_get and many_set and many_get and fresh_set:
            print(
                f"inflight {kib} KiB: store fresh/fresh SET {sf / fresh_set:.2f}x, existing/"
                f"{count}-key SET {se / many_set:.2f}x (one-key SET {se / one_set:.2f}x); "
                f"load/{count}-key GET {ld / many_get:.2f}x (one-key GET {ld / one_get:.2f}x)"
            )
    bare_rate = best.get("bare receive (Python, 1 conn, 1 MiB)")
    if bare_rate and many_get:
        loaded = best.get("umbp load, inflight 1024 KiB")
        print(
            f"bare receive / {count}-key GET {bare_rate / many_get:.2f}x"
            + (f"; umbp load (1 MiB) / bare receive {loaded / bare_rate:.2f}x" if loaded else "")
        )


if __name__ == "__main__":
    main()
