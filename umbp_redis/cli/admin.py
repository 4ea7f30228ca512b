"""Operator verbs of ``umbp-redis``: ls, inspect, stats, purge, doctor.

They use redis-py (one client, SCAN only, never KEYS). Every verb takes
``--redis-url`` (default ``$UMBP_REDIS_URL``, else ``redis://localhost:6379/0``) and
``--json``; human tables are the default.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

from umbp_redis.data.keys import (
    NAMESPACE_RE,
    is_marker_key,
    namespace_pattern,
    old_schema_patterns,
    parse_key,
)
from umbp_redis.store.redispy import redispy_client, server_name, stated_payload_len
from umbp_redis.store.settings import DEFAULT_URL, RedisSettings
from umbp_redis.store.value_format import (
    HEADER_FIELD,
    ChecksumMismatch,
    InvalidValue,
    KeyDigestMismatch,
    body_field,
    check_stored_value,
    decode_header,
)

_PROGRESS_EVERY = 10_000


# The servers the test suite runs against (docs/operations.md, "Servers").
TESTED_SERVERS = {"Redis": 7, "Valkey": 8}


def _server_tested(name: str) -> bool:
    """Whether ``name`` (``server_name``) is of a major version the tests run against."""
    kind, _, version = name.partition(" ")
    try:
        return int(version.split(".")[0]) >= TESTED_SERVERS.get(kind, 1 << 30)
    except ValueError:
        return False


def add_server_args(p: argparse.ArgumentParser) -> None:
    """``--redis-url`` and ``--cluster``: which server a verb talks to."""
    p.add_argument(
        "--redis-url",
        default=None,
        help=f"server (default: $UMBP_REDIS_URL, else {DEFAULT_URL})",
    )
    p.add_argument(
        "--cluster",
        choices=("auto", "true", "false"),
        default="auto",
        help="whether the server is a Redis Cluster node (auto: ask it); on a cluster "
        "every verb covers every master",
    )


def register(sub: Any) -> None:
    """Add the operator verbs to the CLI."""

    def common(p: argparse.ArgumentParser) -> None:
        add_server_args(p)
        p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("ls", help="list namespaces and keys with their decoded fields")
    common(p)
    p.add_argument("--namespace", default=None, help="only this namespace")
    p.add_argument("--limit", type=int, default=50, help="keys to list (default 50)")
    p.set_defaults(handler=cmd_ls)

    p = sub.add_parser("inspect", help="decode and validate one stored value")
    common(p)
    p.add_argument("key")
    p.set_defaults(handler=cmd_inspect)

    p = sub.add_parser("stats", help="per-namespace and server cache statistics")
    common(p)
    p.add_argument("--namespace", default=None, help="only this namespace")
    p.set_defaults(handler=cmd_stats)

    p = sub.add_parser("purge", help="delete one namespace's keys (UNLINK in batches)")
    common(p)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument(
        "--namespace", help="the namespace to delete (exact name: no globs, never empty)"
    )
    which.add_argument("--all", action="store_true", help="every umbp-redis key of every namespace")
    which.add_argument(
        "--old-schemas",
        action="store_true",
        help="every key of an earlier key-schema version (never read by this version)",
    )
    p.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    p.set_defaults(handler=cmd_purge)

    p = sub.add_parser("doctor", help="check that the server can serve as a cache")
    common(p)
    p.set_defaults(handler=cmd_doctor)


def _client(args: argparse.Namespace) -> Any:
    """A redis-py client for ``--redis-url`` (else ``$UMBP_REDIS_URL``, else the default).

    The URL is read by the connector's own parser, so a URL means the same server, user
    and password here as in ``kv_connector_extra_config``; ``$UMBP_REDIS_PASSWORD``
    supplies a password the URL leaves out.
    """
    settings = RedisSettings.from_options(
        {"redis_url": args.redis_url, "cluster": getattr(args, "cluster", "auto")}
    )
    return redispy_client(settings)


def _is_cluster(r: Any) -> bool:
    import redis

    return isinstance(r, redis.RedisCluster)


def _per_master(r: Any, call: Any) -> list[tuple[str, Any]]:
    """``call(client, target_nodes)`` on every master (one standalone server: itself)."""
    if _is_cluster(r):
        return [(n.name, call(r, n)) for n in r.get_primaries()]
    kw = r.connection_pool.connection_kwargs
    name = kw.get("path") or f"{kw.get('host')}:{kw.get('port')}"
    return [(str(name), call(r, None))]


def _info(section: str) -> Any:
    def call(r: Any, node: Any) -> Any:
        return r.info(section) if node is None else r.info(section, target_nodes=node)

    return call


def _scan(r: Any, namespace: str | None, pattern: str | None = None) -> Iterator[bytes]:
    n = 0
    for key in r.scan_iter(match=pattern or namespace_pattern(namespace), count=1000):
        n += 1
        if n % _PROGRESS_EVERY == 0:
            print(f"... scanned {n} keys", file=sys.stderr, flush=True)
        yield key


def _emit(
    args: argparse.Namespace,
    obj: Any,
    table: list[list[str]] | None = None,
    header: list[str] | None = None,
    text: str | None = None,
) -> None:
    if args.json:
        print(json.dumps(obj, indent=2, default=str))
        return
    if text:
        print(text)
    if table is not None and header is not None:
        rows = [header] + table
        widths = [max(len(str(r[i])) for r in rows) for i in range(len(header))]
        for r in rows:
            print("  ".join(str(c).ljust(w) for c, w in zip(r, widths, strict=True)).rstrip())


def _rank_label(tp: int | None, pcp: int, dcp: int, pp: int) -> str:
    return f"tp{'*' if tp is None else tp}:pcp{pcp}:dcp{dcp}:pp{pp}"


def _key_info(r: Any, keys: list[bytes]) -> list[dict[str, Any]]:
    p = r.pipeline(transaction=False)
    for k in keys:
        p.hget(k, HEADER_FIELD)
        p.ttl(k)
    replies = p.execute(raise_on_error=False)
    out = []
    for i, k in enumerate(keys):
        h, ttl = replies[2 * i : 2 * i + 2]
        try:
            d = parse_key(k)
        except ValueError:
            continue
        size = stated_payload_len(h)
        out.append(
            {
                "key": k.decode(),
                "namespace": d.namespace,
                "rank": _rank_label(d.tp_rank, d.pcp_rank, d.dcp_rank, d.pp_rank),
                "group": d.group_id,
                "block_hash": d.block_hash.hex(),
                "value_bytes": size,
                "ttl_s": ttl if isinstance(ttl, int) else None,
            }
        )
    return out


def cmd_ls(args: argparse.Namespace) -> int:
    """``ls``: namespaces with key counts, then up to ``--limit`` keys."""
    r = _client(args)
    counts: dict[str, int] = defaultdict(int)
    markers: dict[str, int] = defaultdict(int)
    sample: list[bytes] = []
    for key in _scan(r, args.namespace):
        try:
            counts[parse_key(key).namespace] += 1
        except ValueError:
            if is_marker_key(key):
                markers[key.split(b":", 4)[3].decode()] += 1
            continue
        if len(sample) < args.limit:
            sample.append(key)
    old = 0
    if args.namespace is None:
        old = sum(1 for p in old_schema_patterns() for _ in _scan(r, None, p))
    keys = _key_info(r, sample)
    lines = [
        f"namespace {ns}: {counts.get(ns, 0)} keys, {markers.get(ns, 0)} stored markers"
        for ns in sorted(set(counts) | set(markers))
    ]
    if old:
        lines.append(
            f"{old} keys of an earlier key schema (never read; purge --old-schemas removes them)"
        )
    _emit(
        args,
        {
            "namespaces": dict(counts),
            "stored_markers": dict(markers),
            "old_schema_keys": old,
            "keys": keys,
        },
        text="\n".join(lines) or "no umbp-redis keys",
    )
    if not args.json and keys:
        print()
        _emit(
            args,
            None,
            [
                [
                    k["namespace"],
                    k["rank"],
                    str(k["group"]),
                    k["block_hash"][:16] + "...",
                    str(k["value_bytes"]),
                    str(k["ttl_s"]),
                ]
                for k in keys
            ],
            ["namespace", "rank", "group", "block hash", "value bytes", "ttl s"],
        )
    return 0


def inspect_value(r: Any, key: str) -> dict[str, Any]:
    """Decode and validate the value under ``key`` (used by ``inspect``)."""
    info: dict[str, Any] = {"key": key}
    if is_marker_key(key):
        present = bool(r.exists(key))
        info.update(
            stored_marker=True,
            valid=present,
            ttl_s=r.ttl(key) if present else None,
            note="a block's stored marker: every rank's value of the block was stored "
            "(the key lookups read; its values are the tp.../g... keys of the same hash)",
        )
        if not present:
            info["error"] = "no such key"
        return info
    try:
        d = parse_key(key)
        info["decoded_key"] = {
            "namespace": d.namespace,
            "tp": d.tp_rank,
            "pcp": d.pcp_rank,
            "dcp": d.dcp_rank,
            "pp": d.pp_rank,
            "group": d.group_id,
            "block_hash": d.block_hash.hex(),
        }
    except ValueError as e:
        info["decoded_key"] = None
        info["key_error"] = str(e)
    kind = r.type(key).decode()
    info["redis_type"] = kind
    if kind == "none":
        info.update(valid=False, error="no such key")
        return info
    info["ttl_s"] = r.ttl(key)
    info["memory_usage"] = r.memory_usage(key)
    if kind != "hash":
        info.update(valid=False, error=f"value is a {kind}, not an umbp-redis hash")
        return info
    h = r.hget(key, HEADER_FIELD)
    try:
        if h is None:
            raise InvalidValue("field h missing")
        hdr = decode_header(h)
        info.update(
            format_version=hdr.version,
            layout_fingerprint=hdr.fingerprint.hex(),
            payload_len=hdr.payload_len,
            body_len=hdr.body_len,
            parts=len(hdr.part_lengths),
        )
        bodies = r.hmget(key, [body_field(i) for i in range(len(hdr.part_layout()))])
        check_stored_value(key.encode(), h, bodies)
        info.update(key_digest="ok", checksum="ok" if hdr.has_checksum else "absent")
        info["valid"] = True
    except KeyDigestMismatch as e:
        info.update(valid=False, error=str(e), key_digest="MISMATCH")
    except ChecksumMismatch as e:
        info.update(valid=False, error=str(e), key_digest="ok", checksum="MISMATCH")
    except InvalidValue as e:
        info.update(valid=False, error=str(e))
    return info


def cmd_inspect(args: argparse.Namespace) -> int:
    """``inspect KEY``: exit 0 when the value is valid, 1 otherwise."""
    info = inspect_value(_client(args), args.key)
    _emit(args, info, [[k, str(v)] for k, v in info.items()], ["field", "value"])
    return 0 if info.get("valid") else 1


def cmd_stats(args: argparse.Namespace) -> int:
    """``stats``: keys, bytes and TTL spread per namespace; server memory and hit rates."""
    r = _client(args)
    per: dict[str, dict[str, Any]] = defaultdict(lambda: {"keys": 0, "bytes": 0, "ttls": []})
    batch: list[bytes] = []

    def flush() -> None:
        for k in _key_info(r, batch):
            st = per[k["namespace"]]
            st["keys"] += 1
            st["bytes"] += k["value_bytes"] or 0
            if k["ttl_s"] is not None and k["ttl_s"] >= 0:
                st["ttls"].append(k["ttl_s"])
        batch.clear()

    for key in _scan(r, args.namespace):
        batch.append(key)
        if len(batch) >= 1000:
            flush()
    flush()
    namespaces = {}
    for ns, st in per.items():
        t = st.pop("ttls")
        namespaces[ns] = {
            **st,
            "ttl_min_s": min(t) if t else None,
            "ttl_median_s": statistics.median(t) if t else None,
            "ttl_max_s": max(t) if t else None,
        }
    mems = dict(_per_master(r, _info("memory")))
    nodes: dict[str, dict[str, Any]] = {}
    for name, sts in _per_master(r, _info("stats")):
        mem = mems[name]
        nodes[name] = {
            "used_memory": int(mem["used_memory"]),
            "maxmemory": int(mem.get("maxmemory", 0)),
            "maxmemory_policy": mem.get("maxmemory_policy"),
            "evicted_keys": int(sts.get("evicted_keys", 0)),
            "expired_keys": int(sts.get("expired_keys", 0)),
            "keyspace_hits": int(sts.get("keyspace_hits", 0)),
            "keyspace_misses": int(sts.get("keyspace_misses", 0)),
        }
    server: dict[str, Any] = {
        k: sum(n[k] for n in nodes.values())
        for k in (
            "used_memory",
            "maxmemory",
            "evicted_keys",
            "expired_keys",
            "keyspace_hits",
            "keyspace_misses",
        )
    }
    server["maxmemory_policy"] = ",".join(
        sorted({str(n["maxmemory_policy"]) for n in nodes.values()})
    )
    server["server"] = ", ".join(
        sorted({server_name(i) for _, i in _per_master(r, _info("server"))})
    )
    hits, misses = server["keyspace_hits"], server["keyspace_misses"]
    server["hit_rate"] = hits / (hits + misses) if hits + misses else None
    server["masters"] = len(nodes)
    _emit(
        args,
        {"namespaces": namespaces, "server": server, "nodes": nodes},
        [
            [
                ns,
                str(v["keys"]),
                str(v["bytes"]),
                f"{v['ttl_min_s']}/{v['ttl_median_s']}/{v['ttl_max_s']}",
            ]
            for ns, v in sorted(namespaces.items())
        ],
        ["namespace", "keys", "bytes", "ttl min/median/max s"],
    )
    if not args.json:
        print()
        for k, v in server.items():
            print(f"{k:18} {v}")
        if len(nodes) > 1:
            print()
            _emit(
                args,
                None,
                [
                    [name, str(n["used_memory"]), str(n["maxmemory"]), str(n["evicted_keys"])]
                    for name, n in sorted(nodes.items())
                ],
                ["master", "used memory", "maxmemory", "evicted keys"],
            )
    return 0


def cmd_purge(args: argparse.Namespace) -> int:
    """``purge --namespace NS``, ``purge --all`` or ``purge --old-schemas``: UNLINK those
    keys, 500 per round trip.

    A namespace must be an exact name (an empty one or a glob would match others);
    both forms ask for confirmation unless ``--yes``; exit 2 on a refused argument.
    """
    if not args.all and not args.old_schemas and not NAMESPACE_RE.match(args.namespace or ""):
        print(
            f"refusing to purge namespace {args.namespace!r}: give an exact namespace "
            "(1-64 letters, digits, '_', '.', '-'; no globs), or --all for every namespace",
            file=sys.stderr,
        )
        return 2
    what = (
        "every umbp-redis key of every namespace"
        if args.all
        else "every key of an earlier key schema"
        if args.old_schemas
        else f"every key of namespace {args.namespace}"
    )
    r = _client(args)
    if not args.yes:
        if not sys.stdin.isatty():
            print("refusing to purge without --yes (no terminal to ask on)", file=sys.stderr)
            return 2
        want = "all" if args.all else "y"
        answer = input(f"delete {what}? type {want!r} to confirm: ")
        if answer.strip().lower() not in ((want,) if args.all else ("y", "yes")):
            print("nothing deleted")
            return 1
    deleted, batch = 0, []
    patterns = old_schema_patterns() if args.old_schemas else (None,)
    namespace = None if args.all or args.old_schemas else args.namespace
    for key in (k for p in patterns for k in _scan(r, namespace, p)):
        batch.append(key)
        if len(batch) >= 500:
            deleted += r.unlink(*batch)
            batch = []
    if batch:
        deleted += r.unlink(*batch)
    _emit(
        args,
        {"namespace": namespace, "old_schemas": bool(args.old_schemas), "deleted": deleted},
        text=f"deleted {deleted} keys"
        + (
            f" of namespace {namespace}"
            if namespace
            else " of earlier key schemas"
            if args.old_schemas
            else ""
        ),
    )
    return 0


def _server_checks(r: Any, add: Any) -> None:
    """maxmemory, eviction policy and persistence of every master (named on a cluster)."""
    import redis

    cluster = _is_cluster(r)

    def config(param: str) -> Any:
        def call(c: Any, node: Any) -> str:
            try:
                got = (
                    c.config_get(param) if node is None else c.config_get(param, target_nodes=node)
                )
            except redis.ResponseError:  # CONFIG refused (an ACL without it)
                return ""
            return str(got.get(param, ""))

        return call

    saves = dict(_per_master(r, config("save")))
    io_threads = dict(_per_master(r, config("io-threads")))
    for name, info in _per_master(r, _info("all")):
        where = f"{name}: " if cluster else ""
        maxmem, policy = int(info.get("maxmemory", 0)), str(info.get("maxmemory_policy"))
        if maxmem == 0:
            add(
                "warn",
                "maxmemory",
                f"{where}not set: Redis grows until the machine runs out of memory",
            )
        else:
            add("ok", "maxmemory", f"{where}{maxmem} bytes")
        if policy == "noeviction":
            add(
                "warn",
                "eviction",
                f"{where}maxmemory-policy is noeviction: stores fail when memory is full",
            )
        else:
            add("ok", "eviction", f"{where}maxmemory-policy {policy}")
        add(
            "ok",
            "io threads",
            f"{where}{server_name(info)} io-threads {io_threads.get(name) or 'unknown'}",
        )
        persist = []
        if int(info.get("aof_enabled", 0)):
            persist.append("AOF on")
        if saves.get(name):
            persist.append(f"RDB save '{saves[name]}'")
        add(
            "warn" if persist else "ok",
            "persistence",
            where + (", ".join(persist) + " (a cache needs none)" if persist else "off"),
        )


def _cluster_checks(r: Any, add: Any) -> None:
    """Cluster state, slot coverage, replicas of every master and full coverage."""
    import redis

    primaries = r.get_primaries()
    info = r.cluster_info(target_nodes=primaries[0])
    state = str(info.get("cluster_state"))
    add("ok" if state == "ok" else "fail", "cluster state", f"cluster_state:{state}")
    assigned, ok_slots = (
        int(info.get("cluster_slots_assigned", 0)),
        int(info.get("cluster_slots_ok", 0)),
    )
    add(
        "ok" if ok_slots == 16384 else ("fail" if assigned < 16384 else "warn"),
        "slot coverage",
        f"{ok_slots}/16384 slots served ({assigned} assigned) by {len(primaries)} masters",
    )
    for n in primaries:
        rep = r.info("replication", target_nodes=n)
        links = [v for k, v in rep.items() if k.startswith("slave") and isinstance(v, dict)]
        online = sum(1 for v in links if v.get("state") == "online")
        if online == 0:
            add(
                "warn",
                "replicas",
                f"{n.name}: no replica online: if it fails its slots are served by nobody "
                "(misses) until it is back",
            )
        else:
            add("ok", "replicas", f"{n.name}: {online} replica(s) online")
        try:
            full = r.config_get("cluster-require-full-coverage", target_nodes=n).get(
                "cluster-require-full-coverage"
            )
        except redis.ResponseError:
            full = None
        if full == "yes":
            add(
                "warn",
                "full coverage",
                f"{n.name}: cluster-require-full-coverage yes: while one master is down "
                "every master refuses reads and writes; set it to no",
            )
        elif full is not None:
            add("ok", "full coverage", f"{n.name}: cluster-require-full-coverage {full}")


def cmd_doctor(args: argparse.Namespace) -> int:
    """``doctor``: 0 when the server (every master of a cluster) can serve as a cache
    (warnings allowed), 2 otherwise."""
    import redis

    r = _client(args)
    checks: list[dict[str, str]] = []

    def add(level: str, name: str, detail: str) -> None:
        checks.append({"level": level, "check": name, "detail": detail})

    try:
        t0 = time.perf_counter()
        r.ping()
        lat = []
        for _ in range(20):
            t = time.perf_counter()
            r.ping()
            lat.append((time.perf_counter() - t) * 1e3)
        add("ok", "reachable", f"PING answered in {(time.perf_counter() - t0) * 1e3:.1f} ms")
        add("ok", "latency", f"PING p50 {statistics.median(lat):.2f} ms")
        names = sorted({server_name(i) for _, i in _per_master(r, _info("server"))})
        untested = [n for n in names if not _server_tested(n)]
        if untested:
            add(
                "warn",
                "server",
                f"{', '.join(names)}: untested (the tests run on Redis 7 and Valkey 8)",
            )
        else:
            add("ok", "server", ", ".join(names))
        if _is_cluster(r):
            _cluster_checks(r, add)
        _server_checks(r, add)
    except redis.AuthenticationError as e:
        add("fail", "auth", str(e))
    except (redis.ConnectionError, redis.TimeoutError) as e:
        add("fail", "reachable", str(e))
    except redis.RedisError as e:
        add("fail", "server", str(e))
    failed = any(c["level"] == "fail" for c in checks)
    _emit(
        args,
        {"ok": not failed, "cluster": _is_cluster(r), "checks": checks},
        [[c["level"].upper(), c["check"], c["detail"]] for c in checks],
        ["", "check", "detail"],
    )
    return 2 if failed else 0
