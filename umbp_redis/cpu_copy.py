"""Execute block transfer plans on CPU memory with torch copies (the reference path).

A plan's ranges name raw engine addresses; this module maps each address back to the
registered KV storage it lies in, and copies through bounds-checked ``uint8`` views,
so a wrong plan raises instead of touching foreign memory.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping

import torch

from umbp_redis.data import BlockTransferPlan


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
        for r in plan.ranges:
            staging[r.object_offset : r.object_offset + r.length].copy_(
                self._view(r.engine_address, r.length)
            )

    def scatter(self, plan: BlockTransferPlan, staging: torch.Tensor) -> None:
        """Copy ``staging`` (one object's bytes) into the block's engine memory."""
        self._check_staging(plan, staging)
        for r in plan.ranges:
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
