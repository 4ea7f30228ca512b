"""The key schema: prefix, parsing and SCAN patterns (light: no torch, no vLLM).

A block's values, one per rank:
``umbp:vllm:v2:{namespace}:tp{tp}:pcp{pcp}:dcp{dcp}:pp{pp}:g{group_id}:{block_hash hex}``;
its stored marker, one per (block, group), written once every rank's value was stored
and the only key a lookup reads: ``umbp:vllm:v2:{namespace}:stored:g{group_id}:{block_hash hex}``.
With ``store_after_requests`` above 1 a namespace also holds one counter per block,
``umbp:vllm:v2:{namespace}:asked:{block_hash hex}`` (an integer string). Markers and
counters match the namespace's SCAN pattern (``purge`` removes them) but are not value
keys (``parse_key`` refuses them). ``BlockIdentityCodec`` in ``umbp_redis.data`` builds
the keys, this module reads them.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

KEY_PREFIX = "umbp:vllm:v2"
"""First fields of every key this project writes; the ``v2`` is the key-schema version."""

OLD_KEY_PREFIXES = ("umbp:vllm:v1",)
"""Prefixes of earlier key-schema versions: never read (misses), removable by ``purge``."""

NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")
_KEY_RE = re.compile(
    r"^umbp:vllm:v2:(?P<ns>[A-Za-z0-9_.\-]{1,64}):tp(?P<tp>\d+|\*):pcp(?P<pcp>\d+)"
    r":dcp(?P<dcp>\d+):pp(?P<pp>\d+):g(?P<group>\d+):(?P<hash>[0-9a-f]+)$"
)
_MARKER_RE = re.compile(r"^umbp:vllm:v2:[A-Za-z0-9_.\-]{1,64}:stored:g\d+:[0-9a-f]+$")


@dataclass(frozen=True)
class DecodedKey:
    """The fields of one key; ``tp_rank`` is None for a TP-agnostic (``tp*``) key."""

    namespace: str
    tp_rank: int | None
    pcp_rank: int
    dcp_rank: int
    pp_rank: int
    group_id: int
    block_hash: bytes


def parse_key(key: str | bytes) -> DecodedKey:
    """Decode a key of the schema; raises ValueError for anything else."""
    text = key.decode() if isinstance(key, bytes) else key
    m = _KEY_RE.match(text)
    if m is None or len(m["hash"]) % 2:
        raise ValueError(f"not an umbp-redis key: {text!r}")
    return DecodedKey(
        namespace=m["ns"],
        tp_rank=None if m["tp"] == "*" else int(m["tp"]),
        pcp_rank=int(m["pcp"]),
        dcp_rank=int(m["dcp"]),
        pp_rank=int(m["pp"]),
        group_id=int(m["group"]),
        block_hash=bytes.fromhex(m["hash"]),
    )


def namespace_pattern(namespace: str | None = None) -> str:
    """A SCAN ``MATCH`` pattern for every key of ``namespace`` (or of every namespace)."""
    return f"{KEY_PREFIX}:{namespace or '*'}:*"


def value_pattern(namespace: str | None = None, tp_rank: int | None = None) -> str:
    """A SCAN ``MATCH`` pattern for the block values (never markers, counters or the
    announcement stream) of ``namespace`` (or every namespace), of one TP rank if given."""
    rank = f"tp{tp_rank}:" if tp_rank is not None else "tp"
    return f"{KEY_PREFIX}:{namespace or '*'}:{rank}*"


def old_schema_patterns() -> tuple[str, ...]:
    """SCAN ``MATCH`` patterns for every key of an earlier key-schema version."""
    return tuple(f"{p}:*" for p in OLD_KEY_PREFIXES)


def is_marker_key(key: str | bytes) -> bool:
    """Whether ``key`` is a block's stored marker of this schema."""
    text = key.decode() if isinstance(key, bytes) else key
    return _MARKER_RE.match(text) is not None
