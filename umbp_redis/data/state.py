"""Scheduler-side request state and per-event transfer results."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    pass


@dataclass
class RequestTracker:
    """Core request state shared by every runtime mode (scheduler side)."""

    request_id: str
    block_ids: tuple[list[int], ...] = ()
    num_saved_tokens: int = 0
    num_loaded_tokens: int = 0

    def mark_saved(self, token_count: int, block_size: int) -> int:
        """Advance the save watermark to the last complete block boundary of ``token_count``.

        Never moves backwards; returns the watermark (in tokens) after the call.
        """
        if block_size <= 0:
            raise ValueError("block_size must be positive")
        boundary = (max(0, token_count) // block_size) * block_size
        if boundary > self.num_saved_tokens:
            self.num_saved_tokens = boundary
        return self.num_saved_tokens

    def append_blocks(self, new_block_ids: Sequence[Sequence[int]]) -> None:
        """Extend each group's block table with newly allocated blocks."""
        if not self.block_ids:
            self.block_ids = tuple([] for _ in new_block_ids)
        for table, new in zip(self.block_ids, new_block_ids, strict=True):
            table.extend(new)

    def replace_blocks(self, block_ids: Sequence[Sequence[int]]) -> None:
        """Replace stale pre-preemption tables with the resumed request's full tables."""
        self.block_ids = tuple(list(ids) for ids in block_ids)


@dataclass(frozen=True)
class StoreEventResult:
    """How many workers finished one store event, and which keys failed on any of them."""

    event_id: int
    finished_workers: int = 1
    failed_keys: frozenset[str] = frozenset()

    def merge(self, other: StoreEventResult) -> StoreEventResult:
        """Combine two reports of the same event."""
        if other.event_id != self.event_id:
            raise ValueError("cannot merge results of different store events")
        return StoreEventResult(
            self.event_id,
            self.finished_workers + other.finished_workers,
            self.failed_keys | other.failed_keys,
        )
