"""Execute block transfers with torch copies, range by range (the reference path).

A plan's ranges name raw engine addresses; this module maps each address back to the
registered KV storage it lies in, and copies through bounds-checked ``uint8`` views,
so a wrong plan raises instead of touching foreign memory. ``CpuBlockCopier`` runs one
``BlockTransferPlan``; ``TorchBlockCopier`` is the ``BlockCopier`` the worker uses on
CPU (and on CUDA without CuPy), lowering batches through the same range templates as
the GPU kernel.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

import torch

from umbp_redis.block_copy import DoneHandle
from umbp_redis.data import BlockTransferPlan, KVRange, KVRangeTemplate, StagingCopyPlan
from umbp_redis.staging import StagingPool


class PlanOutOfBounds(ValueError):
    """A plan range does not lie inside any registered KV storage."""


class CpuBlockCopier:
    """Gather engine blocks into staging bytes and scatter them back, per plan."""

    def __init__(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        spans: dict[int, torch.Tensor] = {}
        for tensor in kv_caches.values():
            storage = tensor.untyped_storage()
            base = storage.data_ptr()
            if base not in spans:
                spans[base] = torch.empty(0, dtype=torch.uint8, device=tensor.device).set_(
                    storage, 0, (storage.nbytes(),), (1,)
                )
        self._starts = sorted(spans)
        self._flat = [spans[s] for s in self._starts]

    def _view(self, address: int, length: int) -> torch.Tensor:
        i = bisect.bisect_right(self._starts, address) - 1
        if i >= 0:
            start = self._starts[i]
            flat = self._flat[i]
            off = address - start
            if off + length <= flat.numel():
                return flat[off : off + length]
        raise PlanOutOfBounds(f"range at {address:#x} (+{length}) is outside the KV storage")

    def gather(self, plan: BlockTransferPlan, staging: torch.Tensor) -> None:
        """Copy the block's bytes into ``staging`` (a ``uint8`` tensor of ``object_size``)."""
        self._check_staging(plan, staging)
        self.gather_ranges(plan.ranges, staging)

    def scatter(self, plan: BlockTransferPlan, staging: torch.Tensor) -> None:
        """Copy ``staging`` (one object's bytes) into the block's engine memory."""
        self._check_staging(plan, staging)
        self.scatter_ranges(plan.ranges, staging)

    def gather_ranges(self, ranges: Iterable[KVRange], staging: torch.Tensor) -> None:
        """Copy each engine range to its offset in ``staging``."""
        for r in ranges:
            staging[r.object_offset : r.object_offset + r.length].copy_(
                self._view(r.engine_address, r.length)
            )

    def scatter_ranges(self, ranges: Iterable[KVRange], staging: torch.Tensor) -> None:
        """Copy each range's bytes at its offset in ``staging`` to the engine."""
        for r in ranges:
            self._view(r.engine_address, r.length).copy_(
                staging[r.object_offset : r.object_offset + r.length]
            )

    def gather_many(self, plans: Iterable[tuple[BlockTransferPlan, torch.Tensor]]) -> None:
        """``gather`` for each (plan, staging) pair."""
        for plan, staging in plans:
            self.gather(plan, staging)

    def scatter_many(self, plans: Iterable[tuple[BlockTransferPlan, torch.Tensor]]) -> None:
        """``scatter`` for each (plan, staging) pair."""
        for plan, staging in plans:
            self.scatter(plan, staging)

    @staticmethod
    def _check_staging(plan: BlockTransferPlan, staging: torch.Tensor) -> None:
        if staging.dtype != torch.uint8 or staging.numel() < plan.object_size:
            raise ValueError(
                f"staging must be a uint8 tensor of at least {plan.object_size} bytes, got "
                f"{staging.dtype} x {staging.numel()}"
            )


class TorchBlockCopier:
    """``BlockCopier`` with torch copies: every copy has finished when its call returns.

    On CUDA tensors each range is a synchronous copy on the calling thread's current
    stream (correct, but one copy call per range: the GPU path uses the kernel).
    """

    name = "torch"

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        templates: Mapping[int, KVRangeTemplate],
        staging: StagingPool,
        num_blocks: int,
    ) -> None:
        self._ranges = CpuBlockCopier(kv_caches)
        self._templates = dict(templates)
        self._staging = staging
        self._num_blocks = num_blocks

    def engine_point(self) -> object | None:
        """Copies are synchronous: nothing to order against (None)."""
        return None

    def gather(self, plan: StagingCopyPlan) -> DoneHandle:
        """Copy the plan's blocks into its slots now."""
        for template, block_id, slot in self._entries(plan):
            self._ranges.gather_ranges(template.ranges_for(block_id), self._staging.tensor(slot))
        return DoneHandle()

    def scatter(self, plan: StagingCopyPlan, after: object | None = None) -> DoneHandle:
        """Copy the plan's slots into its blocks now."""
        for template, block_id, slot in self._entries(plan):
            self._ranges.scatter_ranges(template.ranges_for(block_id), self._staging.tensor(slot))
        return DoneHandle()

    def _entries(self, plan: StagingCopyPlan) -> list[tuple[KVRangeTemplate, int, int]]:
        out = []
        for gid, bid, slot in zip(plan.group_ids, plan.block_ids, plan.slots, strict=True):
            template = self._templates.get(gid)
            if template is None:
                raise ValueError(f"no range template for cache group {gid}")
            check_entry(bid, slot, self._num_blocks, self._staging, template.object_size)
            out.append((template, bid, slot))
        return out


def check_entry(
    block_id: int, slot: int, num_blocks: int, staging: StagingPool, object_size: int
) -> None:
    """Raise ``ValueError`` unless the block and slot exist and the object fits a slot."""
    if not 0 <= block_id < num_blocks:
        raise ValueError(f"block id {block_id} outside 0..{num_blocks - 1}")
    if not 0 <= slot < staging.num_slots:
        raise ValueError(f"staging slot {slot} outside 0..{staging.num_slots - 1}")
    if object_size > staging.slot_bytes:
        raise ValueError(
            f"a {object_size}-byte object does not fit a {staging.slot_bytes}-byte staging slot"
        )
