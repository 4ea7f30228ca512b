"""The data-plane benchmark behind ``umbp-redis bench dataplane``.

Every figure is measured in one run against one server, beside its baselines:
``redis-benchmark`` (the server's ceiling), plain redis-py with hiredis (the naive
client), this client without its checksum (the checksum's cost) and, for lookups, a
redis-py EXISTS pipeline and sequential EXISTS calls.

It writes only keys of its own run (the key schema's namespace ``bench-<run>``, and
``bench:<run>:...``) and deletes only those: it never flushes a database.
"""

from __future__ import annotations

import functools
import os
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import numpy as np

from umbp_redis.data import BlockIdentityCodec, namespace_pattern
from umbp_redis.store.plane import LoadStatus, RedisDataPlane, StoreStatus
from umbp_redis.store.settings import RedisSettings

FINGERPRINT = b"\x42" * 16
RUN = f"{os.getpid():x}{time.time_ns() & 0xFFFFFF:06x}"
NS = f"bench-{RUN}"


def _block_keys(count: int, tag: int) -> list[str]:
    """Keys of ``count`` blocks of this run's namespace (rank 0, group 0), with made-up
    32-byte hashes (as vLLM's) that ``tag`` keeps apart from other calls'."""
    codec = BlockIdentityCodec(NS)
    return [codec.key(tag.to_bytes(8, "big") + i.to_bytes(24, "big"), 0) for i in range(count)]


def _own_keys(r: Any, pattern: str) -> list[bytes]:
    return list(r.scan_iter(match=pattern, count=1000))


def _delete(r: Any, keys: list[Any]) -> None:
    for i in range(0, len(keys), 500):
        r.unlink(*keys[i : i + 500])


def _interleaved_best(
    a: Callable[[], dict[str, float]], b: Callable[[], dict[str, float]], repeats: int
) -> tuple[dict[str, float], dict[str, float]]:
    """Best (highest) figures of ``a`` and of ``b``, run alternately: the machine's and
    the server's drift (page faults of a fresh server, other load) hits both alike."""
    best_a: dict[str, float] = {}
    best_b: dict[str, float] = {}
    for _ in range(repeats):
        for fn, best in ((a, best_a), (b, best_b)):
            for k, v in fn().items():
                best[k] = max(best.get(k, 0.0), v)
    return best_a, best_b


def _best(fn: Callable[[], float], repeats: int) -> float:
    return min(fn() for _ in range(repeats))


# redis-benchmark's -r is a C int: a larger keyspace silently becomes ONE key.
FRESH_KEYSPACE = 10**8


def _redis_benchmark_args(exe: str, settings: RedisSettings) -> list[str]:
    """redis-benchmark's connection arguments for ``settings`` (4 clients, pipeline 4)."""
    args = [exe, "-c", "4", "-P", "4", "--csv"]
    if settings.scheme == "unix":
        args += ["-s", settings.path or ""]
    else:
        args += ["-h", settings.host, "-p", str(settings.port)]
    if settings.password:
        args += ["-a", settings.password, "--no-auth-warning"]
        if settings.username:
            args += ["--user", settings.username]
    if settings.db:
        args += ["--dbnum", str(settings.db)]
    if settings.tls:
        args += ["--tls"] + (["--cacert", settings.tls_ca_cert] if settings.tls_ca_cert else [])
    return args


def _requests_per_second(out: str) -> float:
    """The rate of the one command of a redis-benchmark ``--csv`` run (nan if none)."""
    for line in out.splitlines()[1:]:
        cols = [c.strip('"') for c in line.split(",")]
        if len(cols) >= 2:
            return float(cols[1])
    return float("nan")


def redis_benchmark_gbps(
    settings: RedisSettings, size: int, count: int, exe: str | None = None
) -> dict[str, float]:
    """SET and GET GB/s of ``redis-benchmark`` (or ``exe``, such as valkey-benchmark:
    4 clients, pipeline 4) at ``size`` bytes,
    moving as many keys as this client does: SET writes ``count`` fresh keys (as the
    client's store does), GET reads ``2 * count`` times over ``count`` existing keys.

    Every key is this run's own (``bench:<run>:rb:...``, the value handed over with
    ``-x``) and is deleted after; redis-benchmark's default key ``key:__rand_int__``,
    which could be a user's, is never written.
    """
    exe = exe or shutil.which("redis-benchmark")
    if exe is None:
        return {"set": float("nan"), "get": float("nan")}
    args = _redis_benchmark_args(exe, settings)
    prefix = f"bench:{RUN}:rb:{size}"
    # -x reads the value from stdin up to a NUL byte: no NUL in it.
    value = (np.random.default_rng(3).integers(1, 256, size, dtype=np.uint8)).tobytes()
    r = _redispy_client(settings)
    try:
        out = subprocess.run(
            [
                *args,
                "-r",
                str(FRESH_KEYSPACE),
                "-n",
                str(count),
                "-x",
                "SET",
                f"{prefix}:s:__rand_int__",
            ],
            input=value,
            capture_output=True,
            timeout=600,
        ).stdout.decode()
        set_rate = _requests_per_second(out)
        _delete(r, _own_keys(r, f"{prefix}:s:*"))
        _set_pipelined(r, [f"{prefix}:g:{i:012d}" for i in range(count)], value)  # 12 digits
        out = subprocess.run(
            [*args, "-r", str(count), "-n", str(2 * count), "GET", f"{prefix}:g:__rand_int__"],
            capture_output=True,
            timeout=600,
        ).stdout.decode()
        get_rate = _requests_per_second(out)
    finally:
        _delete(r, _own_keys(r, f"{prefix}:*"))
        r.close()
    return {"set": set_rate * size / 1e9, "get": get_rate * size / 1e9}


def _redispy_client(settings: RedisSettings) -> Any:
    import redis

    kw: dict[str, Any] = {
        "username": settings.username,
        "password": settings.password,
        "db": settings.db,
    }
    if settings.scheme == "unix":
        return redis.Redis(unix_socket_path=settings.path, **kw)
    return redis.Redis(
        host=settings.host,
        port=settings.port,
        ssl=settings.tls,
        ssl_ca_certs=settings.tls_ca_cert,
        **kw,
    )


def _set_pipelined(r: Any, keys: list[str], value: bytes) -> None:
    """SET every key to ``value`` with redis-py pipelines of about 32 MiB."""
    batch = max(1, (32 << 20) // len(value))
    for i in range(0, len(keys), batch):
        p = r.pipeline(transaction=False)
        for k in keys[i : i + batch]:
            p.set(k, value)
        p.execute()


def redispy_gbps(settings: RedisSettings, size: int, count: int, repeats: int) -> dict[str, float]:
    """Pipelined SET and GET GB/s of plain redis-py (hiredis) at ``size`` bytes."""
    r = _redispy_client(settings)
    value = np.random.default_rng(1).integers(0, 256, size, dtype=np.uint8).tobytes()
    keys = [f"bench:{RUN}:redispy:{size}:{i}" for i in range(count)]
    batch = max(1, (32 << 20) // size)

    def do_set() -> float:
        t0 = time.perf_counter()
        _set_pipelined(r, keys, value)
        return time.perf_counter() - t0

    def do_get() -> float:
        t0 = time.perf_counter()
        for i in range(0, count, batch):
            p = r.pipeline(transaction=False)
            for k in keys[i : i + batch]:
                p.get(k)
            got = p.execute()
            assert all(g is not None and len(g) == size for g in got)
        return time.perf_counter() - t0

    ts, tg = _best(do_set, repeats), _best(do_get, repeats)
    _delete(r, keys)
    r.close()
    return {"set": count * size / ts / 1e9, "get": count * size / tg / 1e9}


def umbp_gbps(plane: RedisDataPlane, size: int, count: int, repeats: int) -> dict[str, float]:
    """This project's store (staging -> Redis) and load (Redis -> staging) GB/s."""
    staging = np.random.default_rng(2).integers(0, 256, (count, size), dtype=np.uint8)
    dest = np.zeros_like(staging)
    keys = _block_keys(count, size)
    store_items = [(k, staging[i]) for i, k in enumerate(keys)]
    load_items = [(k, memoryview(dest[i])) for i, k in enumerate(keys)]

    def do_store() -> float:
        t0 = time.perf_counter()
        st = plane.store(store_items, FINGERPRINT)
        dt = time.perf_counter() - t0
        assert all(s is StoreStatus.STORED for s in st), set(st)
        return dt

    def do_load() -> float:
        t0 = time.perf_counter()
        st = plane.load(load_items, FINGERPRINT)
        dt = time.perf_counter() - t0
        assert all(s is LoadStatus.LOADED for s in st), set(st)
        return dt

    ts, tl = _best(do_store, repeats), _best(do_load, repeats)
    assert np.array_equal(staging, dest)
    plane.delete(keys)
    return {"store": count * size / ts / 1e9, "load": count * size / tl / 1e9}


def lookup_latency_ms(
    plane: RedisDataPlane, settings: RedisSettings, nkeys: int
) -> dict[str, float]:
    """p50 ms of one lookup of ``nkeys`` keys (half present), three ways."""
    r = _redispy_client(settings)
    keys = _block_keys(nkeys, 0)
    p = r.pipeline(transaction=False)
    for k in keys[::2]:
        p.set(k, b"x")
    p.execute()
    expected = [i % 2 == 0 for i in range(nkeys)]

    def t_umbp() -> float:
        t0 = time.perf_counter()
        got = plane.lookup(keys, refresh_ttl=False, timeout=5.0)
        dt = time.perf_counter() - t0
        assert got == expected
        return dt

    def t_pipe() -> float:
        t0 = time.perf_counter()
        pp = r.pipeline(transaction=False)
        for k in keys:
            pp.exists(k)
        got = pp.execute()
        dt = time.perf_counter() - t0
        assert [g == 1 for g in got] == expected
        return dt

    def t_seq() -> float:
        t0 = time.perf_counter()
        got = [r.exists(k) for k in keys]
        dt = time.perf_counter() - t0
        assert [g == 1 for g in got] == expected
        return dt

    def p50(fn: Callable[[], float], runs: int) -> float:
        fn()  # warm up
        return statistics.median(fn() for _ in range(runs)) * 1e3

    out = {
        "keys": nkeys,
        "umbp_ms_p50": p50(t_umbp, 51),
        "redispy_pipeline_ms_p50": p50(t_pipe, 21),
        "sequential_exists_ms_p50": p50(t_seq, 5),
    }
    _delete(r, keys[::2])
    r.close()
    return out


def _dataset_memory(r: Any) -> int:
    """``used_memory`` less the clients' query and reply buffers (they are transient)."""
    info = r.info("memory")
    return int(info["used_memory"]) - int(info.get("mem_clients_normal", 0))


def memory_overhead(
    plane: RedisDataPlane, settings: RedisSettings, size: int, count: int
) -> dict[str, float]:
    """``used_memory`` growth per stored byte: this format, and a plain SET of the payload."""
    r = _redispy_client(settings)
    staging = np.random.default_rng(3).integers(0, 256, (count, size), dtype=np.uint8)

    keys = _block_keys(count, 1 << 63)  # apart from the transfers' keys (tagged by size)

    def grow(write: Callable[[], None]) -> float:
        time.sleep(0.2)
        before = _dataset_memory(r)
        write()
        after = _dataset_memory(r)
        _delete(r, keys)
        return (after - before) / (count * size)

    def umbp() -> None:
        st = plane.store([(k, staging[i]) for i, k in enumerate(keys)], FINGERPRINT)
        assert all(s is StoreStatus.STORED for s in st)
        plane.pool.close()  # their query buffers are not the objects' footprint
        time.sleep(0.2)

    def plain() -> None:
        p = r.pipeline(transaction=False)
        for i, k in enumerate(keys):
            p.set(k, staging[i].tobytes(), ex=3600)
        p.execute()
        r.connection_pool.disconnect()  # likewise for the redis-py connection
        time.sleep(0.2)

    out = {"umbp": grow(umbp), "plain_set": grow(plain)}
    r.close()
    return out


def run_dataplane_bench(
    url: str,
    *,
    sizes: list[int],
    total_bytes: int = 256 << 20,
    repeats: int = 3,
    progress: IO[str] | None = None,
    benchmark_exe: str | None = None,
    lookups_and_memory: bool = True,
) -> dict[str, Any]:
    """Run every measurement and return the JSON-able result; ``benchmark_exe``: the
    server's own benchmark tool (default redis-benchmark); ``lookups_and_memory``
    False measures transfers only."""
    settings = RedisSettings.from_url(url)
    plane = RedisDataPlane(settings)
    plain = RedisDataPlane(RedisSettings.from_url(url, checksum=False))

    def say(msg: str) -> None:
        if progress is not None:
            print(msg, file=progress, flush=True)

    results = []
    for size in sizes:
        count = max(8, total_bytes // size)
        say(f"[bench] {size} B values: redis-benchmark")
        runs = [redis_benchmark_gbps(settings, size, count, benchmark_exe) for _ in range(repeats)]
        rb = {k: max(run[k] for run in runs) for k in ("set", "get")}  # best, as below
        say(f"[bench] {size} B values: plain redis-py")
        rp = redispy_gbps(settings, size, count, repeats)
        say(f"[bench] {size} B values: umbp-redis, checksum on and off interleaved")
        um, un = _interleaved_best(
            functools.partial(umbp_gbps, plane, size, count, 1),
            functools.partial(umbp_gbps, plain, size, count, 1),
            repeats,
        )
        results.append(
            {
                "value_bytes": size,
                "redis_benchmark_set_gbps": rb["set"],
                "redis_benchmark_get_gbps": rb["get"],
                "redispy_set_gbps": rp["set"],
                "redispy_get_gbps": rp["get"],
                "umbp_store_gbps": um["store"],
                "umbp_load_gbps": um["load"],
                "umbp_nochecksum_store_gbps": un["store"],
                "umbp_nochecksum_load_gbps": un["load"],
            }
        )
    lookups = []
    for n in (1000, 8000) if lookups_and_memory else ():
        say(f"[bench] lookup of {n} keys")
        lookups.append(lookup_latency_ms(plane, settings, n))
    mem: dict[str, float] = {}
    mem_plain: dict[str, float] = {}
    for size in (65536, 2097152) if lookups_and_memory else ():
        say(f"[bench] memory footprint of {size} B objects")
        m = memory_overhead(plane, settings, size, max(16, (64 << 20) // size))
        mem[str(size)] = m["umbp"]
        mem_plain[str(size)] = m["plain_set"]
    plane.close()
    plain.close()
    r = _redispy_client(settings)
    leftover = _own_keys(r, namespace_pattern(NS)) + _own_keys(r, f"bench:{RUN}:*")
    _delete(r, leftover)
    r.close()
    return {
        "results": results,
        "lookup": lookups,
        "memory_overhead": mem,
        "memory_overhead_plain_set": mem_plain,
    }


def format_table(result: dict[str, Any]) -> str:
    """The result as human-readable tables with ratios."""
    lines = [
        "value size | redis-benchmark SET/GET GB/s | redis-py SET/GET GB/s | "
        "umbp store/load GB/s | umbp/redis-benchmark | umbp/redis-py"
    ]
    for r in result["results"]:
        rb_s, rb_g = r["redis_benchmark_set_gbps"], r["redis_benchmark_get_gbps"]
        lines.append(
            f"{r['value_bytes']:>10} | {rb_s:6.2f} / {rb_g:6.2f} | "
            f"{r['redispy_set_gbps']:6.2f} / {r['redispy_get_gbps']:6.2f} | "
            f"{r['umbp_store_gbps']:6.2f} / {r['umbp_load_gbps']:6.2f} | "
            f"{r['umbp_store_gbps'] / rb_s:5.2f}x / {r['umbp_load_gbps'] / rb_g:5.2f}x | "
            f"{r['umbp_store_gbps'] / r['redispy_set_gbps']:5.1f}x / "
            f"{r['umbp_load_gbps'] / r['redispy_get_gbps']:5.1f}x"
        )
    lines.append("")
    lines.append("value size | umbp store/load GB/s, checksum on | off | checksum cost (on/off)")
    for r in result["results"]:
        on_s, on_l = r["umbp_store_gbps"], r["umbp_load_gbps"]
        off_s, off_l = r["umbp_nochecksum_store_gbps"], r["umbp_nochecksum_load_gbps"]
        lines.append(
            f"{r['value_bytes']:>10} | {on_s:6.2f} / {on_l:6.2f} | {off_s:6.2f} / {off_l:6.2f} | "
            f"{on_s / off_s:5.2f}x / {on_l / off_l:5.2f}x"
        )
    lines.append("")
    lines.append("lookup keys | umbp p50 ms | redis-py pipeline p50 ms | sequential EXISTS p50 ms")
    for lk in result["lookup"]:
        lines.append(
            f"{lk['keys']:>11} | {lk['umbp_ms_p50']:11.2f} | "
            f"{lk['redispy_pipeline_ms_p50']:24.2f} | {lk['sequential_exists_ms_p50']:10.2f}"
        )
    lines.append("")
    lines.append("object size | used_memory / payload (umbp) | (plain SET)")
    for size, v in result["memory_overhead"].items():
        lines.append(f"{size:>11} | {v:28.3f} | {result['memory_overhead_plain_set'][size]:.3f}")
    return "\n".join(lines)


@dataclass(frozen=True)
class ServerUnderTest:
    """One server of ``bench dataplane --servers``: its kind, binary, benchmark tool and
    I/O threads."""

    kind: str  # "redis" or "valkey"
    server: str  # the server binary
    benchmark: str | None  # its own benchmark tool (redis-benchmark, valkey-benchmark)
    io_threads: int

    @property
    def label(self) -> str:
        """How tables name it, e.g. "valkey io-threads 2"."""
        return f"{self.kind} io-threads {self.io_threads}"


def parse_servers(spec: str, valkey_server: str | None) -> list[ServerUnderTest]:
    """``spec`` such as "redis,valkey:1,valkey:2" (kind, then io-threads, default 1) as
    servers to start; ``ValueError`` naming what is wrong or missing."""
    from umbp_redis.testing.embedded_redis import find_redis_server

    out = []
    for item in (x.strip() for x in spec.split(",") if x.strip()):
        kind, _, threads = item.partition(":")
        if kind == "redis":
            binary = shutil.which("redis-server") or find_redis_server()
            tool = shutil.which("redis-benchmark")
        elif kind == "valkey":
            if not valkey_server or not os.access(valkey_server, os.X_OK):
                raise ValueError(
                    f"no valkey-server at {valkey_server!r}: give --valkey-server or set "
                    "UMBP_VALKEY_SERVER"
                )
            binary = valkey_server
            tool = os.path.join(os.path.dirname(binary), "valkey-benchmark")
            tool = tool if os.access(tool, os.X_OK) else shutil.which("valkey-benchmark")
        else:
            raise ValueError(f"--servers: {kind!r} is not redis or valkey")
        if threads and not threads.isdigit():
            raise ValueError(f"--servers: io-threads of {item!r} is not a number")
        out.append(ServerUnderTest(kind, binary, tool, int(threads or 1)))
    return out


def run_server_comparison(
    servers: list[ServerUnderTest],
    *,
    sizes: list[int],
    total_bytes: int,
    repeats: int,
    progress: IO[str] | None = None,
) -> list[dict[str, Any]]:
    """Transfers (``run_dataplane_bench`` without lookups and memory) against each server
    in turn, each on a private instance with its I/O threads, its own benchmark tool as
    its ceiling."""
    from umbp_redis.store.redispy import server_name
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    out = []
    for srv in servers:
        if progress is not None:
            print(f"[bench] {srv.label}", file=progress, flush=True)
        with EmbeddedRedis(["--io-threads", str(srv.io_threads)], binary=srv.server) as server:
            client = _redispy_client(RedisSettings.from_url(server.url))
            name = server_name(client.info("server"))  # "Valkey 8.0.1", "Redis 7.0.15"
            client.close()
            result = run_dataplane_bench(
                server.url,
                sizes=sizes,
                total_bytes=total_bytes,
                repeats=repeats,
                progress=progress,
                benchmark_exe=srv.benchmark,
                lookups_and_memory=False,
            )
        out.append({"server": srv.label, "version": name.partition(" ")[2], **result})
    return out


def format_server_table(runs: list[dict[str, Any]]) -> str:
    """Per server and value size: this client's store/load GB/s, the server's own
    benchmark tool's SET/GET GB/s, their ratio, and the client's rate against the first
    server's."""
    first = {r["value_bytes"]: r for r in runs[0]["results"]}
    lines = [
        "server (version) | value size | umbp store/load GB/s | its benchmark SET/GET GB/s | "
        f"umbp/benchmark | umbp vs {runs[0]['server']}"
    ]
    for run in runs:
        for r in run["results"]:
            base = first[r["value_bytes"]]
            lines.append(
                f"{run['server']} ({run['version']}) | {r['value_bytes']} | "
                f"{r['umbp_store_gbps']:.2f} / {r['umbp_load_gbps']:.2f} | "
                f"{r['redis_benchmark_set_gbps']:.2f} / {r['redis_benchmark_get_gbps']:.2f} | "
                f"{r['umbp_store_gbps'] / r['redis_benchmark_set_gbps']:.2f}x / "
                f"{r['umbp_load_gbps'] / r['redis_benchmark_get_gbps']:.2f}x | "
                f"{r['umbp_store_gbps'] / base['umbp_store_gbps']:.2f}x / "
                f"{r['umbp_load_gbps'] / base['umbp_load_gbps']:.2f}x"
            )
    return "\n".join(lines)
