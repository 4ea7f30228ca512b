"""What each KV cache group needs from Redis for a hit, and which of its blocks to store.

vLLM's hybrid KV cache manager gives each kind of layer its own cache group. A group's
kind decides which of a prompt's blocks a hit at block boundary ``N`` (the first ``N``
blocks served from Redis) needs:

- full attention: every block before ``N``;
- sliding window (``W`` tokens): the ``ceil((W - 1) / block_size)`` blocks before ``N``,
  the only ones the tokens after ``N`` attend to;
- state (Mamba-style, vLLM's ``mamba_cache_mode: align``): the block holding the state
  at ``N``, i.e. block ``N - 1``.

A hit is the longest boundary every group can serve. Full-attention groups store every
complete block. The others store only the blocks before *hit points*: the end of a
prompt's complete blocks (the same prompt again, or a conversation that continues it)
and the boundary where a prompt left the prefix Redis already held (the end of a shared
prefix, where the next request that shares it will hit).

Plain data: built from vLLM's ``KVCacheConfig`` (read, never kept), no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL_ATTENTION = "full_attention"
SLIDING_WINDOW = "sliding_window"
STATE = "state"


class UnsupportedCacheGroup(ValueError):
    """A KV cache group whose kind this connector cannot serve hits for."""


def block_failures_reportable(config: KVCacheConfig) -> bool:
    """Whether vLLM takes failed loads of this config as block ids
    (``invalid_block_ids``): only with one KV cache group, block ids being per group.
    With several a failed load fails its request (``failed_recving``), which vLLM
    takes for async loads only."""
    return len(config.kv_cache_groups) == 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CacheGroupReach:
    """How far back from a hit point one cache group reads.

    ``reach_blocks`` is how many blocks before the hit point the group needs (0: all
    of them, full attention).
    """

    group_id: int
    kind: str
    block_size: int
    reach_blocks: int = 0

    def needed(self, hit: int, start: int = 0) -> range:
        """Blocks in ``[start, hit)`` this group needs for a hit at block ``hit``
        (blocks below ``start`` are already in the engine)."""
        low = start if self.reach_blocks == 0 else max(start, hit - self.reach_blocks)
        return range(low, max(low, hit))

    def stores_all(self) -> bool:
        """Whether every complete block of this group is stored."""
        return self.reach_blocks == 0

    def stored(self, blocks: range, hit_points: Iterable[int]) -> list[int]:
        """The block indices of ``blocks`` to store: all of them for full attention, else
        those some hit point in ``hit_points`` needs."""
        if self.stores_all():
            return list(blocks)
        wanted: set[int] = set()
        for hit in hit_points:
            wanted.update(self.needed(hit))
        return [i for i in blocks if i in wanted]


def reach_of(group_id: int, spec: Any) -> CacheGroupReach:
    """The reach of a group with vLLM KV cache spec ``spec``.

    Raises ``UnsupportedCacheGroup`` naming the group and its spec for kinds without
    prefix caching (cross attention, encoder-only, Mamba without ``align`` mode, ...)
    and for chunked local attention.
    """
    name = type(spec).__name__
    bs = int(spec.block_size)
    if not spec.prefix_cacheable:
        raise UnsupportedCacheGroup(
            f"KV cache group {group_id} ({name}) has no prefix caching in vLLM"
        )
    if "Mamba" in name or hasattr(spec, "mamba_cache_mode"):
        if getattr(spec, "mamba_cache_mode", "none") != "align":
            raise UnsupportedCacheGroup(
                f"KV cache group {group_id} ({name}) keeps its state at block boundaries "
                f"only with mamba_cache_mode 'align', it has "
                f"{getattr(spec, 'mamba_cache_mode', None)!r}"
            )
        return CacheGroupReach(group_id, STATE, bs, 1)
    if "ChunkedLocal" in name or (
        getattr(spec, "attention_chunk_size", None) and "Full" not in name
    ):
        raise UnsupportedCacheGroup(
            f"KV cache group {group_id} ({name}): chunked local attention is not supported"
        )
    if "Cross" in name or "EncoderOnly" in name:
        raise UnsupportedCacheGroup(f"KV cache group {group_id} ({name}) is not a decoder cache")
    window = getattr(spec, "sliding_window", None)
    if window and "Full" not in name:  # a full-attention spec may carry a merged window
        tokens = int(window) - 1 + int(getattr(spec, "extra_retained_tokens", 0) or 0)
        return CacheGroupReach(group_id, SLIDING_WINDOW, bs, max(1, _cdiv(tokens, bs)))
    if "Attention" in name or "MLA" in name:
        return CacheGroupReach(group_id, FULL_ATTENTION, bs, 0)
    raise UnsupportedCacheGroup(f"KV cache group {group_id} ({name}) is of an unknown kind")


@dataclass(frozen=True)
class CacheGroupPlans:
    """The reach of every transferred cache group, in group order."""

    groups: tuple[CacheGroupReach, ...]

    @classmethod
    def from_kv_cache_config(
        cls, config: KVCacheConfig, group_ids: Sequence[int] | None = None
    ) -> CacheGroupPlans:
        """Plans for ``group_ids`` (default: every group) of a vLLM ``KVCacheConfig``.

        Raises ``UnsupportedCacheGroup`` for a group kind without hits (see
        ``reach_of``) and when the groups' block sizes differ.
        """
        ids = range(len(config.kv_cache_groups)) if group_ids is None else group_ids
        groups = tuple(reach_of(g, config.kv_cache_groups[g].kv_cache_spec) for g in ids)
        sizes = {g.block_size for g in groups}
        if len(sizes) > 1:
            raise UnsupportedCacheGroup(
                f"KV cache groups have different block sizes {sorted(sizes)}; "
                "one block size is needed for one hit boundary"
            )
        return cls(groups)

    @property
    def all_full(self) -> bool:
        """Whether every group stores and needs every block (no hybrid plans)."""
        return all(g.stores_all() for g in self.groups)

    def full_prefix_end(self, start: int, end: int, present: Callable[[int, int], bool]) -> int:
        """The first block in ``[start, end)`` some full-attention group lacks (``end``
        when none lacks one, or there is no such group): where a prompt leaves the
        prefix Redis holds."""
        missing = end
        for pos, g in enumerate(self.groups):
            if g.stores_all():
                for i in range(start, missing):
                    if not present(i, pos):
                        missing = i
                        break
        return missing

    def longest_hit(self, start: int, end: int, present: Callable[[int, int], bool]) -> int:
        """The largest boundary ``N`` in ``[start, end]`` whose needed blocks of every
        group are present (``present(block, position of the group)``); ``start`` when
        none. Blocks below ``start`` are in the engine already.
        """
        return self.longest_hit_below(start, self.full_prefix_end(start, end, present), present)

    def longest_hit_below(
        self, start: int, full_end: int, present: Callable[[int, int], bool]
    ) -> int:
        """``longest_hit`` for a caller that has ``full_end = full_prefix_end(...)``
        already: the full-attention blocks below it are not asked for again."""
        for hit in range(full_end, start, -1):
            if all(
                present(i, pos)
                for pos, g in enumerate(self.groups)
                if not g.stores_all()
                for i in g.needed(hit, start)
            ):
                return hit
        return start
