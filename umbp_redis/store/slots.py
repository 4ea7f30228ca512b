"""Redis Cluster slots: which slot a key hashes to and which master serves each slot.

Plain data and parsing only (no I/O): ``key_slot`` is Redis' CRC16 (XMODEM, which is
what ``binascii.crc_hqx`` computes) modulo 16384, honouring ``{hash tags}``; a
``SlotMap`` is read from a ``CLUSTER SHARDS`` or ``CLUSTER SLOTS`` reply.
"""

from __future__ import annotations

import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

SLOTS = 16384
UNASSIGNED = -1

Address = tuple[str, int]


def key_slot(key: bytes) -> int:
    """The cluster slot of ``key``: CRC16 of the key, or of its first non-empty ``{tag}``."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1 : end]
    return binascii.crc_hqx(key, 0) & (SLOTS - 1)


@dataclass(frozen=True)
class SlotMap:
    """The masters of a cluster and, per slot, the index of the master serving it.

    ``owner[slot]`` is an index into ``masters`` or ``UNASSIGNED``; ``replicas`` maps a
    master to its replicas' addresses (for reporting only).
    """

    masters: tuple[Address, ...]
    owner: tuple[int, ...]
    replicas: tuple[tuple[Address, ...], ...] = ()

    def node_of(self, slot: int) -> Address | None:
        """The master serving ``slot``, or None when no master does."""
        i = self.owner[slot]
        return None if i == UNASSIGNED else self.masters[i]

    @property
    def covered(self) -> int:
        """How many slots a master serves."""
        return sum(1 for i in self.owner if i != UNASSIGNED)

    def moved(self, slot: int, node: Address) -> SlotMap:
        """This map with ``slot`` served by ``node`` (what a ``MOVED`` reply says)."""
        masters = list(self.masters)
        replicas = list(self.replicas) + [()] * (len(masters) - len(self.replicas))
        if node not in masters:
            masters.append(node)
            replicas.append(())
        owner = list(self.owner)
        owner[slot] = masters.index(node)
        return SlotMap(tuple(masters), tuple(owner), tuple(replicas))


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes | bytearray) else str(v)


def _endpoint(host: Any, fallback_host: str) -> str:
    """A node's announced endpoint; ``?``/empty/NULL (unknown) means the node we asked."""
    text = "" if host is None else _text(host)
    return fallback_host if text in ("", "?") else text


def _pairs(flat: Sequence[Any]) -> dict[str, Any]:
    return {_text(flat[i]): flat[i + 1] for i in range(0, len(flat) - 1, 2)}


def _build(ranges: list[tuple[int, int, Address, tuple[Address, ...]]]) -> SlotMap:
    masters: list[Address] = []
    replicas: list[tuple[Address, ...]] = []
    owner = [UNASSIGNED] * SLOTS
    for lo, hi, master, reps in ranges:
        if master not in masters:
            masters.append(master)
            replicas.append(reps)
        idx = masters.index(master)
        for s in range(max(0, lo), min(SLOTS - 1, hi) + 1):
            owner[s] = idx
    return SlotMap(tuple(masters), tuple(owner), tuple(replicas))


def parse_cluster_shards(reply: Any, asked_host: str, *, tls: bool = False) -> SlotMap:
    """A ``SlotMap`` from a ``CLUSTER SHARDS`` reply (Redis 7+, Valkey 8+).

    With ``tls`` a node's ``tls-port`` is used where it has one, else its ``port``. Only
    nodes whose health is ``online`` count; a shard whose master is not online
    serves nothing (its slots are unassigned until a replica is promoted).
    """
    if not isinstance(reply, list):
        raise ValueError(f"CLUSTER SHARDS reply is not an array: {reply!r:.80}")
    ranges: list[tuple[int, int, Address, tuple[Address, ...]]] = []
    for shard in reply:
        info = _pairs(shard)
        slots = [int(x) for x in info.get("slots") or []]
        master: Address | None = None
        reps: list[Address] = []
        for node in info.get("nodes") or []:
            n = _pairs(node)
            host = n.get("endpoint")
            if host is None or _text(host) in ("", "?"):
                host = n.get("ip")
            ports = ("tls-port", "port") if tls else ("port", "tls-port")
            port = next((int(n[p]) for p in ports if n.get(p)), 0)
            addr = (_endpoint(host, asked_host), port)
            health = _text(n.get("health", b"online"))
            if not addr[1] or health == "fail":
                continue
            if _text(n.get("role", b"")) == "master":
                if health == "online":
                    master = addr
            else:
                reps.append(addr)  # online or still loading
        if master is None:
            continue
        for i in range(0, len(slots) - 1, 2):
            ranges.append((slots[i], slots[i + 1], master, tuple(reps)))
    return _build(ranges)


def parse_cluster_slots(reply: Any, asked_host: str) -> SlotMap:
    """A ``SlotMap`` from a ``CLUSTER SLOTS`` reply (older servers)."""
    if not isinstance(reply, list):
        raise ValueError(f"CLUSTER SLOTS reply is not an array: {reply!r:.80}")
    ranges: list[tuple[int, int, Address, tuple[Address, ...]]] = []
    for entry in reply:
        lo, hi, master_info, *rep_infos = entry
        master = (_endpoint(master_info[0], asked_host), int(master_info[1]))
        reps = tuple((_endpoint(r[0], asked_host), int(r[1])) for r in rep_infos)
        ranges.append((int(lo), int(hi), master, reps))
    return _build(ranges)
