"""Rank-local Redis keys of logical blocks (the key schema's writer side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from umbp_redis.data.keys import KEY_PREFIX
from umbp_redis.data.namespace import UMBPNamespace, layer_specs
from umbp_redis.data.topology import RankTopology

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig


@dataclass(frozen=True)
class BlockIdentityCodec:
    """Stable rank-local keys from vLLM block hashes.

    ``umbp:vllm:v2:{namespace}:tp{tp}:pcp{pcp}:dcp{dcp}:pp{pp}:g{group_id}:{hash hex}``,
    and one stored marker per (block, group) for every rank: ``marker_prefix``.
    Groups in ``replicated_groups`` get one TP-agnostic key (``tp*``) that every TP
    rank loads and only TP rank 0 stores. Keys never contain a physical block id, a
    request id or a DP rank, so any engine of the namespace can find them.
    """

    namespace: str
    topology: RankTopology = field(default_factory=RankTopology)
    replicated_groups: frozenset[int] = frozenset()

    def __post_init__(self) -> None:
        UMBPNamespace(self.namespace)  # validates the characters
        object.__setattr__(self, "replicated_groups", frozenset(self.replicated_groups))
        object.__setattr__(self, "_prefixes", {})

    def key_prefixes(self, group_id: int) -> tuple[str, ...]:
        """Every rank's key of ``group_id`` up to the block hash, built once per codec.

        ``prefix + block_hash.hex()`` is that rank's key: the hot path concatenates
        strings and validates nothing (the parts were validated here, once).
        """
        cache: dict[int, tuple[str, ...]] = self._prefixes  # type: ignore[attr-defined]
        out = cache.get(group_id)
        if out is None:
            if not isinstance(group_id, int) or group_id < 0:
                raise ValueError(f"group_id must be a non-negative int, got {group_id!r}")
            agnostic = group_id in self.replicated_groups
            labels = dict.fromkeys(
                r.rank_label(tp_agnostic=agnostic) for r in self.topology.rank_namespaces()
            )
            out = tuple(f"{KEY_PREFIX}:{self.namespace}:{lb}:g{group_id}:" for lb in labels)
            cache[group_id] = out
        return out

    def marker_prefix(self, group_id: int) -> str:
        """``umbp:vllm:v2:{namespace}:stored:g{group_id}:``: with a block's hash hex, the
        key that proves every rank's value of the block in ``group_id`` was stored (the
        one key a lookup reads, at any TP/PP/PCP/DCP)."""
        if not isinstance(group_id, int) or group_id < 0:
            raise ValueError(f"group_id must be a non-negative int, got {group_id!r}")
        return f"{KEY_PREFIX}:{self.namespace}:stored:g{group_id}:"

    def marker_key(self, block_hash: bytes, group_id: int) -> bytes:
        """The stored marker of ``block_hash`` in ``group_id``, as bytes for Redis."""
        return (self.marker_prefix(group_id) + bytes(block_hash).hex()).encode()

    @property
    def request_count_prefix(self) -> str:
        """``umbp:vllm:v2:{namespace}:asked:``: with a block's hash hex, the key counting
        the requests that asked for its prefix (one per block, for every rank and group)."""
        return f"{KEY_PREFIX}:{self.namespace}:asked:"

    def key(self, block_hash: bytes, group_id: int, rank: RankTopology | None = None) -> str:
        """The key of ``block_hash`` in ``group_id`` for ``rank`` (default: this process)."""
        if not isinstance(block_hash, bytes | bytearray) or not block_hash:
            raise TypeError(f"block_hash must be non-empty bytes, got {type(block_hash).__name__}")
        r = rank or self.topology
        label = r.rank_label(tp_agnostic=group_id in self.replicated_groups)
        return f"{KEY_PREFIX}:{self.namespace}:{label}:g{group_id}:{bytes(block_hash).hex()}"

    def rank_keys(self, block_hash: bytes, group_id: int) -> tuple[str, ...]:
        """Every rank's key of one logical block; the block is a hit only if all exist."""
        hx = bytes(block_hash).hex()
        return tuple(p + hx for p in self.key_prefixes(group_id))

    def stores(self, group_id: int) -> bool:
        """Whether this process writes its key of ``group_id`` (replicated: TP rank 0 only)."""
        return group_id not in self.replicated_groups or self.topology.tp_rank == 0


def tp_replicated_group_ids(config: KVCacheConfig, topology: RankTopology) -> frozenset[int]:
    """Groups whose blocks are byte-identical on every TP rank.

    Every layer of the group must declare a single TP shard (``max_tp_shards == 1``,
    e.g. MLA latents and sparse indexers, or a TP-replicated Mamba state); context
    parallelism shards such caches by token, so it opts out.
    """
    if topology.pcp_size > 1 or topology.dcp_size > 1:
        return frozenset()
    out = set()
    for gid, group in enumerate(config.kv_cache_groups):
        specs = list(layer_specs(group).values())
        if specs and all(
            getattr(s, "max_tp_shards", None) == 1 or getattr(s, "tp_replicated", False)
            for s in specs
        ):
            out.add(gid)
    return frozenset(out)
