"""The data plane against a Redis Cluster: one ``RedisDataPlane`` per master.

Keys are spread over the masters by their slot (schema v1 keys have no hash tags, so a
request's blocks use every node's memory and bandwidth). Each master has its own
connection pool, warm lookup connection and health, so a dead master costs only its
own keys.

* ``lookup_blocks``: the keys are grouped by master; one pre-encoded buffer goes to
  every master, then every master's replies are read: one round trip per master, all
  masters at once, from one thread, within ``lookup_timeout_s``. A master that fails,
  times out or answers an error turns its keys into misses.
* ``store``/``load``: grouped by master and run in parallel (each master's part spread
  over ``transfer_connections``). ``MOVED`` updates the map and re-sends once to the
  new owner; ``ASK`` sends once to the named node after ``ASKING``.
* The slot map is re-read in the background after ``MOVED``, ``CLUSTERDOWN`` or a
  failed master (with backoff), and every ``cluster_refresh_s``; one refresh at a
  time, and callers go on with the map they have.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Unpack

from umbp_redis.store.commands import (
    ClusterLookupEncoder,
    ClusterRequestCountEncoder,
    SlottedBlock,
    lookup_commands,
    ttl_argument,
)
from umbp_redis.store.connection import RedisConnection
from umbp_redis.store.errors import RedisDataPlaneError, RedisRedirectError, RedisTimeoutError
from umbp_redis.store.plane import (
    DataPlaneStats,
    KeyedBuffers,
    LoadOptions,
    LoadStatus,
    Outcome,
    RedisDataPlane,
    StoreOptions,
    StoreStatus,
    record_outcomes,
)
from umbp_redis.store.resp import ErrorReply, encode_command, send_buffers
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.slots import (
    SLOTS,
    UNASSIGNED,
    Address,
    SlotMap,
    key_slot,
    parse_cluster_shards,
    parse_cluster_slots,
)
from umbp_redis.store.thread_affinity import thread_pinner

log = logging.getLogger(__name__)
# What ``_route`` runs on one master: (its plane, its share of the items, whether to
# send ``ASKING`` first, the share's indices in the items) -> per-item outcomes.
NodeCall = Callable[[RedisDataPlane, KeyedBuffers, bool, list[int]], list[Any]]

_MIN_REFRESH_GAP_S = 0.1
_MAX_REFRESH_GAP_S = 1.0
_SUSPECT_WATCH_S = 60.0


def read_slot_map(conn: RedisConnection, asked_host: str) -> SlotMap:
    """The cluster's slot map as ``conn``'s node sees it (``CLUSTER SHARDS``, else
    ``CLUSTER SLOTS``); raises ``RedisDataPlaneError`` or ``ValueError``."""
    send_buffers(conn.sock, [encode_command("CLUSTER", "SHARDS")], use_sendmsg=False)
    reply = conn.reader.read_reply()
    if isinstance(reply, ErrorReply):
        if "unknown" not in reply.message.lower():
            raise reply.exc
        send_buffers(conn.sock, [encode_command("CLUSTER", "SLOTS")], use_sendmsg=False)
        reply = conn.reader.read_reply()
        if isinstance(reply, ErrorReply):
            raise reply.exc
        return parse_cluster_slots(reply, asked_host)
    return parse_cluster_shards(reply, asked_host, tls=conn.settings.tls)


class ClusterDataPlane:
    """Lookups, stores and loads against every master of a Redis Cluster."""

    lookup_mode = "cluster"

    def __init__(self, settings: RedisSettings, slot_map: SlotMap | None = None) -> None:
        self.settings = settings
        self.stats = DataPlaneStats()
        self.seeds: tuple[Address, ...] = (
            (settings.host, settings.port),
            *settings.cluster_seed_nodes,
        )
        self._ttl = ttl_argument(settings.ttl_seconds)
        self._nodes: dict[Address, RedisDataPlane] = {}
        self._nodes_lock = threading.Lock()
        self._map = slot_map
        self._map_at = time.monotonic()
        self._refresh_lock = threading.Lock()
        self._refreshing = False
        self._next_refresh_at = 0.0
        self._gap = _MIN_REFRESH_GAP_S
        self._closed = False
        self._counts_lock = threading.Lock()
        self.cluster_counts = {
            "cluster_moved": 0,
            "cluster_ask": 0,
            "cluster_map_refreshes": 0,
            "cluster_map_refresh_failures": 0,
            "cluster_node_failures": 0,
        }
        self.node_failures: dict[str, int] = {}
        # Masters that failed recently (address -> when): while the map still names one
        # of them, it is re-read every refresh gap, so a promoted replica is found
        # without waiting for traffic.
        self._suspects: dict[Address, float] = {}
        self._executor = ThreadPoolExecutor(
            max_workers=32,
            thread_name_prefix="umbp-redis-node",
            initializer=thread_pinner(settings.transfer_cpus),
        )
        if slot_map is None:
            self.refresh_map("startup")
        else:
            self.warm_up()

    # -- nodes and the slot map -------------------------------------------------------

    @property
    def slot_map(self) -> SlotMap | None:
        """The map in use (None until one was read)."""
        return self._map

    def node(self, addr: Address) -> RedisDataPlane:
        """The data plane of one node (made on first use, kept for the process)."""
        plane = self._nodes.get(addr)
        if plane is None:
            with self._nodes_lock:
                plane = self._nodes.get(addr)
                if plane is None:
                    plane = RedisDataPlane(self.settings.for_node(*addr))
                    self._nodes[addr] = plane
        return plane

    def _count(self, name: str, n: int = 1) -> None:
        with self._counts_lock:
            self.cluster_counts[name] += n

    def _node_failed(self, addr: Address, what: str) -> None:
        key = f"{addr[0]}:{addr[1]}"
        with self._counts_lock:
            self.cluster_counts["cluster_node_failures"] += 1
            self.node_failures[key] = self.node_failures.get(key, 0) + 1
            self._suspects[addr] = time.monotonic()
        log.debug("cluster node %s failed %s", key, what)
        self.refresh_map(f"{what} failed on {key}")

    def refresh_map(self, reason: str) -> bool:
        """Start re-reading the slot map in the background; False when one is running or
        the backoff since the last one has not passed. Never waits."""
        now = time.monotonic()
        with self._refresh_lock:
            if self._closed or self._refreshing or now < self._next_refresh_at:
                return False
            self._refreshing = True
        threading.Thread(
            target=self._refresh, args=(reason,), name="umbp-redis-slots", daemon=True
        ).start()
        return True

    def _candidates(self) -> list[Address]:
        m = self._map
        out: list[Address] = []
        if m is not None:
            out.extend(m.masters)
            for reps in m.replicas:
                out.extend(reps)
        out.extend(self.seeds)
        return list(dict.fromkeys(out))

    def _refresh(self, reason: str) -> None:
        new: SlotMap | None = None
        errors: list[str] = []
        old = self._map
        try:
            for addr in self._candidates():
                try:
                    conn = RedisConnection(self.settings.for_node(*addr))
                except RedisDataPlaneError as e:
                    errors.append(f"{addr[0]}:{addr[1]}: {e}")
                    continue
                try:
                    conn.reader.deadline = time.monotonic() + self.settings.op_timeout_s
                    candidate = read_slot_map(conn, addr[0])
                except (RedisDataPlaneError, ValueError, TypeError, IndexError) as e:
                    errors.append(f"{addr[0]}:{addr[1]}: {e}")
                    continue
                finally:
                    conn.close()
                if candidate.covered:
                    new = candidate
                    break
                errors.append(f"{addr[0]}:{addr[1]}: serves no slots")
        except Exception as e:  # never let the thread die silently
            errors.append(repr(e))
        now = time.monotonic()
        changed = new is not None and (
            old is None or new.masters != old.masters or new.owner != old.owner
        )
        with self._refresh_lock:
            if new is not None:
                self._map, self._map_at = new, now
            # Back off while nothing changes (a master down, not yet replaced).
            self._gap = _MIN_REFRESH_GAP_S if changed else min(_MAX_REFRESH_GAP_S, self._gap * 2)
            self._next_refresh_at = now + self._gap
            self._refreshing = False
        self._watch_suspects(new or old, now)
        if new is None:
            self._count("cluster_map_refresh_failures")
            log.warning(
                "umbp-redis: cannot read the Redis Cluster slot map (%s): %s",
                reason,
                "; ".join(errors) or "no node answered",
            )
            return
        self._count("cluster_map_refreshes")
        if changed:
            log.info(
                "umbp-redis: Redis Cluster slot map (%s): %d masters, %d/16384 slots served",
                reason,
                len(new.masters),
                new.covered,
            )
            self.warm_up()

    def _watch_suspects(self, m: SlotMap | None, now: float) -> None:
        """Re-read the map after the refresh gap while a master that failed in the last
        ``_SUSPECT_WATCH_S`` is still in it or its slots are served by nobody (until its
        replica is promoted)."""
        with self._counts_lock:
            for addr, at in list(self._suspects.items()):
                replaced = m is not None and addr not in m.masters and m.covered == SLOTS
                if now - at > _SUSPECT_WATCH_S or replaced:
                    del self._suspects[addr]
            watch = bool(self._suspects)
        if watch and not self._closed:
            timer = threading.Timer(self._gap + 0.01, self.refresh_map, args=("failover watch",))
            timer.daemon = True
            timer.start()

    def _maybe_periodic(self) -> None:
        if time.monotonic() - self._map_at > self.settings.cluster_refresh_s:
            self.refresh_map("periodic")

    def _apply_moved(self, err: RedisRedirectError, asked: Address) -> Address:
        target = (err.host or asked[0], err.port)
        m = self._map
        if m is not None and m.node_of(err.slot) != target:
            with self._refresh_lock:
                if self._map is m:
                    self._map = m.moved(err.slot, target)
        return target

    def warm_up(self) -> None:
        """Start the lookup connection of every master now, off the caller's thread."""
        m = self._map
        for addr in m.masters if m is not None else ():
            self.node(addr).warm_up()

    # -- lookups ----------------------------------------------------------------------

    def lookup_encoder(
        self, prefixes: Sequence[bytes], *, refresh_ttl: bool, hash_hex_len: int
    ) -> ClusterLookupEncoder:
        """The encoder of one block's lookup commands, for ``lookup_blocks``."""
        return ClusterLookupEncoder(
            prefixes, refresh_ttl=refresh_ttl, ttl=self._ttl, hash_hex_len=hash_hex_len
        )

    def request_count_encoder(
        self, prefix: bytes, *, hash_hex_len: int
    ) -> ClusterRequestCountEncoder:
        """The encoder of one block's request count, for ``lookup_blocks``."""
        return ClusterRequestCountEncoder(prefix, ttl=self._ttl, hash_hex_len=hash_hex_len)

    def lookup_blocks(
        self,
        blocks: Sequence[SlottedBlock],
        count: int,
        *,
        timeout: float | None = None,
        counted_from: int | None = None,
    ) -> list[int] | None:
        """Replies (1 per present key) to blocks from ``lookup_encoder``, in order, then
        from reply ``counted_from`` on those of ``request_count_encoder``'s blocks.

        The keys of a master that fails, times out or answers an error read 0 (a miss);
        a request count's error reply reads 0 and fails nothing. None only when no slot
        map is known yet. Ends within ``timeout`` (default ``lookup_timeout_s``).
        """
        end = count if counted_from is None else counted_from
        wait = self.settings.lookup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + wait
        self.stats.add(lookups=1)
        m = self._map
        if m is None:
            self.refresh_map("lookup without a slot map")
            self.stats.add(lookup_errors=1)
            return None
        self._maybe_periodic()
        owner = m.owner
        per_node: dict[int, tuple[list[bytes], list[int]]] = {}
        pos = 0
        for blk in blocks:
            for cmd, slot in zip(blk.cmds, blk.slots, strict=True):
                i = owner[slot]
                if i != UNASSIGNED:
                    entry = per_node.get(i)
                    if entry is None:
                        entry = per_node[i] = ([], [])
                    entry[0].append(cmd)
                    entry[1].append(pos)
                pos += 1
        if pos != count:
            self.stats.add(lookup_errors=1)
            return None
        replies = [0] * count
        failed = pos > sum(len(e[1]) for e in per_node.values())  # slots no master serves
        if failed:
            self.refresh_map("lookup of unserved slots")
        sent: list[tuple[Address, Any, RedisConnection, list[int]]] = []
        for i, (cmds, positions) in per_node.items():
            addr = m.masters[i]
            cm = self.node(addr).lookup_conn.connection(deadline)
            try:
                conn = cm.__enter__()
            except RedisDataPlaneError as e:
                failed = True
                self._lookup_failed(addr, e)
                continue
            try:
                send_buffers(conn.sock, [b"".join(cmds)], use_sendmsg=False, deadline=deadline)
            except BaseException as e:
                cm.__exit__(type(e), e, e.__traceback__)
                failed = True
                if not isinstance(e, RedisDataPlaneError):
                    raise
                self._lookup_failed(addr, e)
                continue
            sent.append((addr, cm, conn, positions))
        hits = 0
        for addr, cm, conn, positions in sent:
            try:
                got = conn.reader.read_int_replies(len(positions))
            except BaseException as e:
                cm.__exit__(type(e), e, e.__traceback__)
                failed = True
                if isinstance(e, RedisDataPlaneError):
                    self._lookup_failed(addr, e)
                else:
                    self._unexpected_lookup(e)
                continue
            cm.__exit__(None, None, None)
            errors = [
                r
                for p, r in zip(positions, got, strict=True)
                if p < end and isinstance(r, ErrorReply)
            ]
            if errors:
                failed = True
                self.node(addr)._note_refusals(errors, "EXPIRE")
                self._node_failed(addr, f"lookup ({errors[0].message[:60]})")
            for p, r in zip(positions, got, strict=True):
                if p >= end:
                    replies[p] = r if isinstance(r, int) else 0
                elif r == 1:
                    replies[p] = 1
                    hits += 1
        self.stats.add(lookup_keys=end, lookup_hits=hits, lookup_errors=int(failed))
        return replies

    def _lookup_failed(self, addr: Address, e: RedisDataPlaneError) -> None:
        if isinstance(e, RedisTimeoutError):
            self.stats.add(lookup_timeouts=1)
        self._node_failed(addr, "lookup")

    def _unexpected_lookup(self, e: BaseException) -> None:
        self.stats.add(unexpected_errors=1)
        log.error("umbp-redis: unexpected error in a cluster lookup (a miss): %r", e)

    def lookup(
        self,
        keys: Sequence[str | bytes],
        *,
        refresh_ttl: bool | None = None,
        timeout: float | None = None,
    ) -> list[bool] | None:
        """Presence of each key, in order (as ``RedisDataPlane.lookup``; keys on a failed
        master read as absent)."""
        refresh = self.settings.refresh_ttl_on_lookup if refresh_ttl is None else refresh_ttl
        blocks = []
        for k in keys:
            kb = k if isinstance(k, bytes) else k.encode()
            cmd, _ = lookup_commands([kb], refresh_ttl=refresh, ttl=self._ttl)
            blocks.append(SlottedBlock((cmd,), (key_slot(kb),)))
        replies = self.lookup_blocks(blocks, len(blocks), timeout=timeout)
        return None if replies is None else [r == 1 for r in replies]

    # -- stores and loads --------------------------------------------------------------

    def _route(
        self, items: KeyedBuffers, call: NodeCall, on_error: Outcome, what: str
    ) -> list[Outcome]:
        """Run ``call`` on each master's share of ``items`` in parallel; follow ``MOVED``
        and ``ASK`` once. Per-item results, in order."""
        out: list[Outcome] = [on_error] * len(items)
        m = self._map
        if m is None:
            self.refresh_map(f"{what} without a slot map")
            return out
        self._maybe_periodic()
        groups: dict[tuple[Address, bool], list[int]] = {}
        unserved = 0
        for i, (key, _) in enumerate(items):
            node = m.node_of(key_slot(key if isinstance(key, bytes) else key.encode()))
            if node is not None:
                groups.setdefault((node, False), []).append(i)
            else:
                unserved += 1
        if unserved:
            self.refresh_map(f"{what} of unserved slots")
        for attempt in range(2):
            if not groups:
                break
            futures = {
                target: self._executor.submit(
                    self._guarded, call, target[0], idx, items, target[1], on_error
                )
                for target, idx in groups.items()
            }
            retry: dict[tuple[Address, bool], list[int]] = {}
            for (addr, asking), fut in futures.items():
                idx = groups[(addr, asking)]
                res = fut.result()
                node_error = False
                for i, r in zip(idx, res, strict=True):
                    if isinstance(r, RedisRedirectError):
                        if r.kind == "MOVED":
                            self._count("cluster_moved")
                            target = (self._apply_moved(r, addr), False)
                        else:
                            self._count("cluster_ask")
                            target = ((r.host or addr[0], r.port), True)
                        if attempt == 0:
                            retry.setdefault(target, []).append(i)
                        continue
                    out[i] = r
                    node_error |= r in (StoreStatus.ERROR, LoadStatus.ERROR)
                if node_error:
                    self._node_failed(addr, what)
            if any(not asking for _, asking in retry):
                self.refresh_map(f"MOVED on a {what}")
            groups = retry
        return out

    def _guarded(
        self,
        call: NodeCall,
        addr: Address,
        idx: list[int],
        items: KeyedBuffers,
        asking: bool,
        on_error: Outcome,
    ) -> list[Any]:
        try:
            return call(self.node(addr), [items[i] for i in idx], asking, idx)
        except Exception as e:  # a bug fails these keys, nothing more
            self.stats.add(unexpected_errors=1)
            log.error("umbp-redis: unexpected error on cluster node %s: %r", addr, e)
            return [on_error] * len(idx)

    def store(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[StoreOptions]
    ) -> list[StoreStatus]:
        """Write each (key, payload) on its master with a TTL; per-key status, in order
        (as ``RedisDataPlane.store``, its options included)."""
        if not items:
            return []
        out = self._route(
            items,
            lambda plane, sub, asking, _idx: plane.store_raw(
                sub, fingerprint, asking=asking, **options
            ),
            StoreStatus.ERROR,
            "store",
        )
        record_outcomes(self.stats, items, out)
        return out

    def load(
        self, items: KeyedBuffers, fingerprint: bytes, **options: Unpack[LoadOptions]
    ) -> list[LoadStatus]:
        """Read each key from its master into its buffer; per-key status, in order (as
        ``RedisDataPlane.load``, its options included: a key redirected to another node
        reports its parts from there)."""
        if not items:
            return []
        on_loaded, on_part = options.get("on_loaded"), options.get("on_part")

        def node_load(
            plane: RedisDataPlane, sub: KeyedBuffers, asking: bool, idx: list[int]
        ) -> list[LoadStatus | RedisRedirectError]:
            # The node's indices are into its share: map them back to ``items``.
            found = None if on_loaded is None else lambda done: on_loaded([idx[j] for j in done])
            got = None if on_part is None else lambda p, done: on_part(p, [idx[j] for j in done])
            node_options: LoadOptions = {**options, "on_loaded": found, "on_part": got}
            return plane.load_raw(sub, fingerprint, asking=asking, **node_options)

        out = self._route(items, node_load, LoadStatus.ERROR, "load")
        record_outcomes(self.stats, items, out)
        return out

    def delete(self, keys: Sequence[str | bytes], *, deadline: float | None = None) -> int:
        """UNLINK keys, one command per slot on its master; the number removed (the
        nodes that answer by ``deadline``, monotonic seconds, when given)."""
        m = self._map
        if m is None or not keys:
            return 0
        by_node: dict[Address, dict[int, list[bytes]]] = {}
        for k in keys:
            kb = k if isinstance(k, bytes) else k.encode()
            slot = key_slot(kb)
            node = m.node_of(slot)
            if node is not None:
                by_node.setdefault(node, {}).setdefault(slot, []).append(kb)
        removed = 0
        for addr, slots in by_node.items():
            buf = b"".join(encode_command("UNLINK", *ks) for ks in slots.values())
            try:
                replies = self.node(addr)._int_round_trip(buf, len(slots), deadline=deadline)
            except RedisDataPlaneError:
                continue
            removed += sum(r for r in replies if isinstance(r, int))
        return removed

    def run_keyed(
        self, commands: Sequence[tuple[bytes, bytes]], *, timeout: float
    ) -> list[int] | None:
        """``RedisDataPlane.run_keyed`` with each command sent to its key's master, one
        round trip per master, one master after another: the commands of a master that
        fails, or of a slot no master serves, read -1 (unknown). None without a slot map."""
        m = self._map
        if m is None:
            self.refresh_map("keyed commands without a slot map")
            return None
        by_node: dict[Address, tuple[list[tuple[bytes, bytes]], list[int]]] = {}
        for pos, (k, cmd) in enumerate(commands):
            node = m.node_of(key_slot(k))
            if node is not None:
                entry = by_node.setdefault(node, ([], []))
                entry[0].append((k, cmd))
                entry[1].append(pos)
        out = [-1] * len(commands)
        for addr, (cmds, positions) in by_node.items():
            got = self.node(addr).run_keyed(cmds, timeout=timeout)
            if got is None:
                self._node_failed(addr, "keyed commands")
                continue
            for p, r in zip(positions, got, strict=True):
                out[p] = r
        if sum(len(e[1]) for e in by_node.values()) < len(commands):
            self.refresh_map("keyed commands of unserved slots")
        return out

    def query_keyed(self, key: bytes, command: bytes, *, timeout: float) -> Any:
        """``RedisDataPlane.query_keyed`` on the key's master; None without a slot map,
        where no master serves the key's slot, or where the master failed."""
        m = self._map
        if m is None:
            self.refresh_map("a keyed query without a slot map")
            return None
        addr = m.node_of(key_slot(key))
        if addr is None:
            self.refresh_map("a keyed query of an unserved slot")
            return None
        return self.node(addr).query_keyed(key, command, timeout=timeout)

    # -- misc -------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """Every counter: transfers and lookups, refused logins/commands of all nodes,
        redirects, map refreshes and failed-node events."""
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        with self._counts_lock:
            cluster = dict(self.cluster_counts)
        unexpected = sum(n.stats.snapshot()["unexpected_errors"] for n in nodes)
        snap = self.stats.snapshot()
        snap["unexpected_errors"] += unexpected
        return {**snap, **cluster, "auth_failures": sum(n.auth.count for n in nodes)}

    def node_counters(self) -> dict[str, int]:
        """Failed-node events per master ("host:port")."""
        with self._counts_lock:
            return dict(self.node_failures)

    def ping(self) -> float | None:
        """Round-trip seconds of a PING to the first master that answers, or None."""
        m = self._map
        for addr in m.masters if m is not None else ():
            t = self.node(addr).ping()
            if t is not None:
                return t
        return None

    def close(self) -> None:
        """Stop the I/O threads and close every node's connections."""
        with self._refresh_lock:
            self._closed = True
        self._executor.shutdown(wait=True)
        with self._nodes_lock:
            nodes = list(self._nodes.values())
        for n in nodes:
            n.close()
