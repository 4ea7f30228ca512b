"""The fleet's block announcements: one Redis Stream per namespace, plain data here.

Every engine that publishes KV cache events appends an entry to
``umbp:vllm:v2:{namespace}:announced`` for each block it stored in Redis (and for each
block it found gone), and reads the entries of the other engines, so that its own event
stream tells a router about every block of the namespace: any engine can load them.
An entry is a flat field list:

- ``o``: ``s`` (stored) or ``r`` (removed);
- ``e``: the announcing engine's id (an engine skips its own entries);
- ``g``: the cache group; ``h``: the block hash; ``p``: the parent block hash (absent
  for a first block);
- ``t``: the block's token ids, unsigned 32-bit little endian (stored entries only);
- ``m``: JSON of what else vLLM puts into a block's event, only where it is set: the
  extra keys (``x``, lists for tuples), the LoRA id (``li``) and name (``ln``).

This module builds and reads entries; ``umbp_redis.engine.fleet_blocks`` does the I/O.
"""

from __future__ import annotations

import json
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from umbp_redis.data.keys import KEY_PREFIX

STORED = b"s"
REMOVED = b"r"


def announcement_key(namespace: str) -> str:
    """The Redis key of ``namespace``'s announcement stream."""
    return f"{KEY_PREFIX}:{namespace}:announced"


@dataclass(frozen=True)
class Announcement:
    """One block stored in Redis, or found gone, as an engine announced it."""

    stored: bool
    engine: str
    block_hash: bytes
    group: int
    parent_hash: bytes | None = None
    token_ids: tuple[int, ...] = ()
    extra_keys: tuple[Any, ...] | None = None
    lora_id: int | None = None
    lora_name: str | None = None

    @property
    def block(self) -> tuple[bytes, int]:
        """(block hash, cache group): what a router's index and a marker are keyed by."""
        return (self.block_hash, self.group)

    def fields(self) -> list[bytes]:
        """The entry's field list, name and value alternating, for ``XADD``."""
        out = [b"o", STORED if self.stored else REMOVED, b"e", self.engine.encode()]
        out += [b"g", str(self.group).encode(), b"h", self.block_hash]
        if self.parent_hash is not None:
            out += [b"p", self.parent_hash]
        if self.stored:
            out += [b"t", array("I", self.token_ids).tobytes()]
        meta: dict[str, Any] = {}
        if self.extra_keys is not None:
            meta["x"] = list(self.extra_keys)
        if self.lora_id is not None:
            meta["li"] = self.lora_id
        if self.lora_name is not None:
            meta["ln"] = self.lora_name
        if meta:
            out += [b"m", json.dumps(meta, separators=(",", ":")).encode()]
        return out


def _tuples(value: Any) -> Any:
    """``value`` with every JSON list turned back into a tuple, as vLLM's keys are."""
    if isinstance(value, list):
        return tuple(_tuples(v) for v in value)
    return value


def parse_announcement(fields: Sequence[bytes]) -> Announcement | None:
    """The announcement of one stream entry's field list, or None where it is not a
    well-formed entry of this format (an entry is never trusted further than that)."""
    if len(fields) % 2:
        return None
    d = {bytes(fields[i]): bytes(fields[i + 1]) for i in range(0, len(fields), 2)}
    try:
        op, engine, group, block_hash = d[b"o"], d[b"e"].decode(), int(d[b"g"]), d[b"h"]
        if op not in (STORED, REMOVED) or not block_hash or group < 0:
            return None
        tokens: tuple[int, ...] = ()
        if op == STORED:
            raw = d[b"t"]
            if len(raw) % 4:
                return None
            tokens = tuple(array("I", raw))
        meta = json.loads(d[b"m"]) if b"m" in d else {}
        if not isinstance(meta, dict):
            return None
        extra = meta.get("x")
        lora_id = meta.get("li")
        lora_name = meta.get("ln")
        if extra is not None and not isinstance(extra, list):
            return None
        if lora_id is not None and not isinstance(lora_id, int):
            return None
        if lora_name is not None and not isinstance(lora_name, str):
            return None
    except (KeyError, ValueError, UnicodeDecodeError):
        return None
    return Announcement(
        op == STORED,
        engine,
        block_hash,
        group,
        d.get(b"p"),
        tokens,
        _tuples(extra) if extra is not None else None,
        lora_id,
        lora_name,
    )
