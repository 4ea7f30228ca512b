"""Execute block transfers with torch copies (the reference path, and the CPU executor).

A plan's ranges name raw engine addresses; this module maps each address back to the
registered KV storage it lies in, and copies through bounds-checked ``uint8`` views,
so a wrong plan raises instead of touching foreign memory. ``KVStorageRanges`` runs one
``BlockTransferPlan`` range by range (the reference); ``TorchBlockCopier`` is the
``BlockCopier`` the worker uses on CPU (and on CUDA without CuPy): it lowers batches
through the same range templates as the GPU kernel, merged into strided runs, so a
batch of consecutive blocks in vLLM's CPU layout is one copy call.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from typing import NamedTuple

import torch

from umbp_redis.data import (
    BlockTransferPlan,
    KVRange,
    KVRangeRun,
    KVRangeTemplate,
    StagingCopyPlan,
)
from umbp_redis.engine.copy.interface import DoneHandle
from umbp_redis.engine.staging import StagingPool


class PlanOutOfBounds(ValueError):
    """A plan range does not lie inside any registered KV storage."""


class KVStorageRanges:
    """The engine's registered KV storages, addressed by engine byte ranges: finds the
    storage a range lies in (bounds-checked views) and copies a plan's ranges between
    it and staging bytes one range at a time (the reference copy)."""

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

    def _storage_of(self, lo: int, hi: int) -> int | None:
        """The index of the storage holding engine bytes ``lo .. hi - 1``, or None."""
        i = bisect.bisect_right(self._starts, lo) - 1
        if i >= 0 and hi - self._starts[i] <= self._flat[i].numel():
            return i
        return None

    def _view(self, address: int, length: int) -> torch.Tensor:
        i = self._storage_of(address, address + length)
        if i is None:
            raise PlanOutOfBounds(f"range at {address:#x} (+{length}) is outside the KV storage")
        off = address - self._starts[i]
        return self._flat[i][off : off + length]

    def locate_run(self, run: KVRangeRun, num_blocks: int) -> tuple[torch.Tensor, int] | None:
        """The flat bytes of the storage that holds the run for every block id below
        ``num_blocks``, and block 0's offset in them; None where no one storage does."""
        span = (run.count - 1) * run.step + run.length
        ends = (run.engine_base, run.engine_base + (num_blocks - 1) * run.block_stride)
        i = self._storage_of(min(ends), max(ends) + span)
        if i is None:
            return None
        return self._flat[i], run.engine_base - self._starts[i]

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

    @staticmethod
    def _check_staging(plan: BlockTransferPlan, staging: torch.Tensor) -> None:
        if staging.dtype != torch.uint8 or staging.numel() < plan.object_size:
            raise ValueError(
                f"staging must be a uint8 tensor of at least {plan.object_size} bytes, got "
                f"{staging.dtype} x {staging.numel()}"
            )


class _BoundRun(NamedTuple):
    """A ``KVRangeRun`` inside one storage: its flat bytes and block 0's offset there."""

    flat: torch.Tensor
    offset: int
    run: KVRangeRun


class TorchBlockCopier:
    """``BlockCopier`` with torch copies: every copy has finished when its call returns.

    Each group's template is merged into strided runs (``KVRangeTemplate.runs``), and
    the entries of a plan into sequences of consecutive block ids going to consecutive
    slots; one ``copy_`` moves one run of a whole sequence. vLLM's CPU layout (every
    layer of a block one layer stride apart in a shared tensor) is one run, so a
    batch of consecutive blocks is one copy call. On CUDA tensors the calls run on the
    calling thread's current stream and finish before returning (the GPU path uses
    the kernel).
    """

    name = "torch"

    def __init__(
        self,
        kv_caches: Mapping[str, torch.Tensor],
        templates: Mapping[int, KVRangeTemplate],
        staging: StagingPool,
        num_blocks: int,
    ) -> None:
        ranges = KVStorageRanges(kv_caches)
        self._object_sizes = {gid: t.object_size for gid, t in templates.items()}
        self._staging = staging
        self._num_blocks = num_blocks
        self._runs = {
            gid: _bind_runs(ranges, template, num_blocks) for gid, template in templates.items()
        }
        # Blocks are batched along their stride; a group whose stride is not positive
        # (no vLLM layout) copies block by block.
        self._batch_blocks = {
            gid: all(b.run.block_stride > 0 for b in runs) for gid, runs in self._runs.items()
        }

    def engine_point(self) -> object | None:
        """Copies are synchronous: nothing to order against (None)."""
        return None

    def receive_views(self, group_id: int, block_id: int) -> list[memoryview] | None:
        """The block's object as views of the engine's host memory, in object order
        (adjacent pieces merged), so a load can receive into the block with no copy;
        None for CUDA tensors or a block id out of range."""
        runs = self._runs.get(group_id)
        if runs is None or not 0 <= block_id < self._num_blocks:
            return None
        pieces: list[tuple[torch.Tensor, int, int]] = []  # storage bytes, offset, length
        for bound in runs:
            if bound.flat.device.type != "cpu":
                return None
            r = bound.run
            for k in range(r.count):
                off = bound.offset + block_id * r.block_stride + k * r.step
                last = pieces[-1] if pieces else None
                if last is not None and last[0] is bound.flat and last[1] + last[2] == off:
                    pieces[-1] = (last[0], last[1], last[2] + r.length)
                else:
                    pieces.append((bound.flat, off, r.length))
        return [flat[off : off + n].numpy().data for flat, off, n in pieces]

    def gather(self, plan: StagingCopyPlan) -> DoneHandle:
        """Copy the plan's blocks into its slots now."""
        self._copy(plan, to_staging=True)
        return DoneHandle()

    def scatter(self, plan: StagingCopyPlan, after: object | None = None) -> DoneHandle:
        """Copy the plan's slots into its blocks now."""
        self._copy(plan, to_staging=False)
        return DoneHandle()

    def _copy(self, plan: StagingCopyPlan, *, to_staging: bool) -> None:
        groups = checked_groups(plan, self._object_sizes, self._num_blocks, self._staging)
        rows = self._staging.buffer
        for gid, (blocks, slots) in groups.items():
            runs = self._runs[gid]
            if self._batch_blocks[gid]:
                sequences = consecutive_sequences(blocks, slots)
            else:
                sequences = [(b, s, 1) for b, s in zip(blocks, slots, strict=True)]
            for first_block, first_slot, n in sequences:
                for bound in runs:
                    r = bound.run
                    engine = bound.flat.as_strided(
                        (n, r.count, r.length),
                        (r.block_stride if n > 1 else 0, r.step, 1),
                        bound.offset + first_block * r.block_stride,
                    )
                    span = rows[first_slot : first_slot + n, r.object_offset :]
                    obj = span[:, : r.count * r.length].unflatten(1, (r.count, r.length))
                    if to_staging:
                        obj.copy_(engine)
                    else:
                        engine.copy_(obj)


def consecutive_sequences(
    blocks: Sequence[int], slots: Sequence[int]
) -> list[tuple[int, int, int]]:
    """(first block, first slot, length) of the maximal runs of entries, in block order,
    whose block ids and slots both go up by one from entry to entry."""
    out: list[tuple[int, int, int]] = []
    for b, s in sorted(zip(blocks, slots, strict=True)):
        if out:
            b0, s0, n = out[-1]
            if b == b0 + n and s == s0 + n:
                out[-1] = (b0, s0, n + 1)
                continue
        out.append((b, s, 1))
    return out


def _bind_runs(
    ranges: KVStorageRanges, template: KVRangeTemplate, num_blocks: int
) -> list[_BoundRun]:
    """The template's runs located in the KV storage for every block id; a run that no
    one storage holds is split into its ranges. Raises ``PlanOutOfBounds`` for a range
    outside the storage."""
    out: list[_BoundRun] = []
    for run in template.runs():
        found = ranges.locate_run(run, num_blocks)
        if found is not None:
            out.append(_BoundRun(*found, run))
            continue
        for piece in run.pieces():
            found = ranges.locate_run(piece, num_blocks)
            if found is None:
                raise PlanOutOfBounds(
                    f"range at {piece.engine_base:#x} (+{piece.length}) is outside the KV "
                    f"storage for some of the {num_blocks} blocks"
                )
            out.append(_BoundRun(*found, piece))
    return out


def checked_groups(
    plan: StagingCopyPlan,
    object_sizes: Mapping[int, int],
    num_blocks: int,
    staging: StagingPool,
) -> dict[int, tuple[tuple[int, ...], tuple[int, ...]]]:
    """``plan.by_group()``, after raising ``ValueError`` for a group without a range
    template (``object_sizes`` names those that have one), a block or slot that does not
    exist, or an object larger than a slot."""
    groups = plan.by_group()
    for gid, (blocks, slots) in groups.items():
        object_size = object_sizes.get(gid)
        if object_size is None:
            raise ValueError(f"no range template for cache group {gid}")
        if object_size > staging.slot_bytes:
            raise ValueError(
                f"a {object_size}-byte object does not fit a {staging.slot_bytes}-byte staging slot"
            )
        for block_id, slot in zip(blocks, slots, strict=True):
            if not 0 <= block_id < num_blocks:
                raise ValueError(f"block id {block_id} outside 0..{num_blocks - 1}")
            if not 0 <= slot < staging.num_slots:
                raise ValueError(f"staging slot {slot} outside 0..{staging.num_slots - 1}")
    return groups
