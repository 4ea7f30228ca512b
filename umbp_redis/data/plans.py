"""Transfer plans: what one step moves, block by block, and where."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, overload

from umbp_redis.data.ranges import KVRange

if TYPE_CHECKING:
    pass


@dataclass(frozen=True)
class BlockTransferPlan:
    """One complete logical block transfer.

    The logical part (block hash, group, engine block id, request) comes from the
    scheduler; the physical part (key, ranges, size, fingerprint) is filled in on the
    worker by ``KVLayoutPlanner.plan_for_block``.
    """

    block_id: int
    group_id: int
    key: str = ""
    block_hash: bytes = b""
    request_id: str | None = None
    object_size: int = 0
    layout_fingerprint: bytes = b""
    ranges: tuple[KVRange, ...] = ()


@dataclass(frozen=True)
class StagingCopyPlan:
    """Which engine blocks are copied to (stores) or from (loads) which staging slots.

    Columnar: entry ``i`` moves engine block ``block_ids[i]`` of cache group
    ``group_ids[i]`` to or from staging slot ``slots[i]``. Slots are distinct.
    """

    group_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    slots: tuple[int, ...]

    def __post_init__(self) -> None:
        n = len(self.group_ids)
        if len(self.block_ids) != n or len(self.slots) != n:
            raise ValueError(
                f"StagingCopyPlan columns differ in length: {n} groups, "
                f"{len(self.block_ids)} blocks, {len(self.slots)} slots"
            )
        if len(set(self.slots)) != n:
            raise ValueError("StagingCopyPlan slots must be distinct")

    def __len__(self) -> int:
        return len(self.slots)

    def by_group(self) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
        """(block ids, slots) of each cache group, in plan order."""
        out: dict[int, tuple[list[int], list[int]]] = {}
        for gid, bid, slot in zip(self.group_ids, self.block_ids, self.slots, strict=True):
            blocks, slots = out.setdefault(gid, ([], []))
            blocks.append(bid)
            slots.append(slot)
        return {g: (tuple(b), tuple(s)) for g, (b, s) in out.items()}


@dataclass(frozen=True)
class _BlockBatch(Sequence[BlockTransferPlan]):
    """Columnar whole-block transfers of one request; request data shared by all."""

    request_id: str
    block_hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    group_ids: tuple[int, ...]
    event_id: int = 0

    def __post_init__(self) -> None:
        n = len(self.block_hashes)
        if len(self.block_ids) != n or len(self.group_ids) != n:
            raise ValueError(
                f"{type(self).__name__} columns differ in length: {n} hashes, "
                f"{len(self.block_ids)} block ids, {len(self.group_ids)} group ids"
            )

    def __len__(self) -> int:
        return len(self.block_ids)

    @overload
    def __getitem__(self, i: int) -> BlockTransferPlan: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[BlockTransferPlan]: ...

    def __getitem__(self, i: int | slice) -> BlockTransferPlan | Sequence[BlockTransferPlan]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return BlockTransferPlan(
            block_id=self.block_ids[i],
            group_id=self.group_ids[i],
            block_hash=self.block_hashes[i],
            request_id=self.request_id,
        )

    def __iter__(self) -> Iterator[BlockTransferPlan]:
        for i in range(len(self)):
            yield self[i]


@dataclass(frozen=True)
class BlockLoadBatch(_BlockBatch):
    """Whole-block loads (Redis -> engine) of one request.

    ``fail_all``: the scheduler could not plan this load after promising its tokens to
    vLLM; the workers report every block as not loaded, so vLLM recomputes them.
    ``load_async``: the request waits for the load (vLLM's ``WAITING_FOR_REMOTE_KVS``);
    when false the workers load before the step's forward pass.
    """

    fail_all: bool = False
    load_async: bool = True


@dataclass(frozen=True)
class BlockStoreBatch(_BlockBatch):
    """Whole-block stores (engine -> Redis) of one request; ``event_id`` names the store
    event the workers report back."""


@dataclass(frozen=True)
class LoadSpec:
    """Scheduler decision for one externally loaded prefix.

    ``local_tokens`` are already computed (vLLM prefix cache), ``external_tokens`` is
    the block-aligned prefix present in Redis; the difference is loaded.
    """

    local_tokens: int
    external_tokens: int
    load_async: bool = True

    def __post_init__(self) -> None:
        if self.local_tokens < 0 or self.external_tokens < self.local_tokens:
            raise ValueError(
                f"LoadSpec needs 0 <= local_tokens <= external_tokens, got "
                f"{self.local_tokens} and {self.external_tokens}"
            )
