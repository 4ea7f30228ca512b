"""Keys for tests and their fixtures, built by the product's own key schema
(``umbp_redis.data``): a schema change never means editing tests by hand."""

from __future__ import annotations

from umbp_redis.data import BlockIdentityCodec, RankTopology


def block_hash(tag: str, i: int) -> bytes:
    """A made-up block hash: the tag's bytes, then ``i`` (distinct per (tag, i))."""
    return tag.encode() + i.to_bytes(30, "big")


def block_keys(
    n: int,
    tag: str = "t",
    namespace: str = "test",
    group_id: int = 0,
    rank: RankTopology | None = None,
) -> list[str]:
    """The value keys of ``n`` made-up blocks of ``namespace`` (rank 0 unless given)."""
    codec = BlockIdentityCodec(namespace, rank or RankTopology())
    return [codec.key(block_hash(tag, i), group_id) for i in range(n)]


def rank_prefixes(namespace: str = "test", tp_size: int = 1, group_id: int = 0) -> list[bytes]:
    """Every TP rank's key prefix of ``group_id`` (a block's hash hex completes each), in
    rank order, as the lookup encoders take them."""
    codec = BlockIdentityCodec(namespace, RankTopology(tp_size=tp_size))
    return [p.encode() for p in codec.key_prefixes(group_id)]


def counter_prefix(namespace: str = "test") -> bytes:
    """The prefix of ``namespace``'s request counters (a block's hash hex completes one)."""
    return BlockIdentityCodec(namespace).request_count_prefix.encode()
