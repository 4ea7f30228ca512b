"""One load batch from Redis into its KV blocks: receive, validate, copy, clean up."""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Callable
from typing import Any

from umbp_redis.data import BlockLoadBatch, BlockTransferPlan, StagingCopyPlan
from umbp_redis.engine.copy.interface import BlockCopier
from umbp_redis.engine.layer_gate import LayerGate
from umbp_redis.engine.load_scatter import ScatterAsLoaded
from umbp_redis.engine.staging import StagingPool
from umbp_redis.engine.stats import StatsRecorder
from umbp_redis.engine.worker_ledger import WorkerLedger
from umbp_redis.store.deployment import DataPlane
from umbp_redis.store.plane import LoadStatus

log = logging.getLogger(__name__)


def by_fingerprint(plans: list[BlockTransferPlan]) -> dict[bytes, list[int]]:
    """Plan indices grouped by object layout (one data-plane call per layout)."""
    groups: dict[bytes, list[int]] = defaultdict(list)
    for i, p in enumerate(plans):
        groups[p.layout_fingerprint].append(i)
    return groups


def copy_plan(plans: list[BlockTransferPlan], slots: list[int]) -> StagingCopyPlan:
    """The copier's view of blocks and their staging slots."""
    return StagingCopyPlan(
        group_ids=tuple(p.group_id for p in plans),
        block_ids=tuple(p.block_id for p in plans),
        slots=tuple(slots),
    )


def _positions(
    scatters: ScatterAsLoaded | None, idx: list[int]
) -> Callable[[list[int]], None] | None:
    """The plane's ``on_loaded`` for one of a load's fingerprint groups: positions in the
    group (``idx``) are mapped back to positions in the load."""
    if scatters is None:
        return None
    return lambda done: scatters.launch([idx[j] for j in done])


def _arrivals(gate: LayerGate | None, group: int) -> Callable[[int, list[int]], None] | None:
    """The plane's ``on_part`` for one cache group of a load by layer."""
    if gate is None:
        return None
    return lambda part, done: gate.arrived(group, part, done)


class BlockLoader:
    """Loads batches of blocks for one worker.

    Host KV caches take the values straight into the destination blocks (no staging,
    no copy; ``direct_loads``); device caches receive into staging and copy each valid
    value into its block, each window's copies started as it arrives where the copier
    is asynchronous (``scatter_as_loaded``: None chooses, True or False forces). A
    value that fails validation is never used: its block is reported failed (vLLM
    recomputes it) and the value removed from Redis; values that would fail again are
    owed to the scheduler's quarantine through the ledger.
    """

    def __init__(
        self,
        plane: DataPlane,
        stats: StatsRecorder,
        ledger: WorkerLedger,
        is_cancelled: Callable[[str], bool],
    ) -> None:
        self.plane = plane
        self.stats = stats
        self.ledger = ledger
        self.is_cancelled = is_cancelled
        self.staging: StagingPool | None = None
        self.copier: BlockCopier | None = None
        self.part_lengths: dict[bytes, tuple[int, ...]] = {}  # by layout fingerprint
        self.direct_loads = True
        self.scatter_as_loaded: bool | None = None

    def receive_views(self, plans: list[BlockTransferPlan]) -> list[list[memoryview]] | None:
        """Each block's engine memory to receive its value into, or None where the
        copier needs staging (device memory) for any of them."""
        views_of = getattr(self.copier, "receive_views", None)
        if views_of is None or not self.direct_loads:
            return None
        out = []
        for p in plans:
            views = views_of(p.group_id, p.block_id)
            if views is None or sum(v.nbytes for v in views) != p.object_size:
                return None
            out.append(views)
        return out

    def load(
        self,
        batch: BlockLoadBatch,
        plans: list[BlockTransferPlan],
        deadline: float | None,
        after: object | None,
        gate: LayerGate | None = None,
    ) -> set[int]:
        """Load ``plans`` (the blocks of ``batch``) by ``deadline``, copies ordered after
        the engine's work ``after``; with ``gate``, each part is announced as it
        arrives. Returns the block ids that did not load. Never raises."""
        slots: list[int] | None = None
        scatters: ScatterAsLoaded | None = None
        try:
            targets: list[Any] | None = self.receive_views(plans)
            staging, copier = self.staging, self.copier
            if targets is None and staging is not None:
                slots = staging.acquire(len(plans))
                if slots is not None:
                    targets = [
                        staging.array(slot)[: p.object_size]
                        for slot, p in zip(slots, plans, strict=True)
                    ]
            if targets is None or copier is None:
                return {p.block_id for p in plans}
            early: ScatterAsLoaded | None = None  # copies started as windows arrive
            if slots is not None:
                staged = slots
                scatters = ScatterAsLoaded(
                    copier,
                    lambda ii: copy_plan([plans[i] for i in ii], [staged[i] for i in ii]),
                    after,
                    lambda: self.is_cancelled(batch.request_id),
                )
                overlap = self.scatter_as_loaded
                if overlap is None:
                    overlap = after is not None  # engine_point is None: synchronous copies
                early = scatters if overlap else None
            statuses = self._receive(plans, targets, deadline, early, gate, direct=slots is None)
            copy_failed: set[int] = set()
            if scatters is not None:
                # Every valid block is copied (a plane that reported none is caught up
                # here) and all copies are done before the request is reported. A failed
                # copy fails its block (recomputed) without blaming the value.
                scatters.launch([i for i, st in enumerate(statuses) if st is LoadStatus.LOADED])
                scatters.wait()
                copy_failed = scatters.failed
            if gate is not None:  # every byte is in: the forward pass may read all layers
                gate.open_all()
            if self.is_cancelled(batch.request_id):
                return set()
            self._settle_bad_values(batch.request_id, plans, statuses, deadline)
            loaded = [
                i
                for i, st in enumerate(statuses)
                if st is LoadStatus.LOADED and i not in copy_failed
            ]
            self.stats.add(
                blocks_loaded=len(loaded), bytes_loaded=sum(plans[i].object_size for i in loaded)
            )
            done = set(loaded)
            return {p.block_id for i, p in enumerate(plans) if i not in done}
        except Exception as e:  # never let a transfer bug reach the engine: recompute instead
            log.error("umbp-redis load of %s failed: %r", batch.request_id, e)
            return set(batch.block_ids)
        finally:
            if scatters is not None:
                scatters.wait()  # no copy may still read a slot that is handed back
            if gate is not None:
                gate.open_all()
            if slots is not None and self.staging is not None:
                self.staging.release(slots)

    def _receive(
        self,
        plans: list[BlockTransferPlan],
        targets: list[Any],
        deadline: float | None,
        early: ScatterAsLoaded | None,
        gate: LayerGate | None,
        *,
        direct: bool,
    ) -> list[LoadStatus]:
        """Each block's load status, one data-plane call per object layout."""
        statuses: list[LoadStatus] = [LoadStatus.ERROR] * len(plans)
        for fp, idx in by_fingerprint(plans).items():
            res = self.plane.load(
                [(plans[i].key, targets[i]) for i in idx],
                fp,
                deadline=deadline,
                on_loaded=_positions(early, idx),
                parts=self.part_lengths.get(fp),
                # Straight into the blocks: each part is usable once in (by layer).
                on_part=_arrivals(gate, plans[idx[0]].group_id) if direct else None,
            )
            for i, s in zip(idx, res, strict=True):
                statuses[i] = s
        return statuses

    def _settle_bad_values(
        self,
        request_id: str,
        plans: list[BlockTransferPlan],
        statuses: list[LoadStatus],
        deadline: float | None,
    ) -> None:
        """Remove invalid values from Redis and owe the scheduler the values that would
        fail again: error replies (the value stays) and invalid values that could not
        be removed. A removed one is a miss until stored again. Missing values are
        reported too: the scheduler deletes their blocks' stored markers."""
        missing = [
            p.block_hash for p, st in zip(plans, statuses, strict=True) if st is LoadStatus.MISSING
        ]
        if missing:
            self.ledger.values_removed(missing)
        invalid = [p for p, st in zip(plans, statuses, strict=True) if st is LoadStatus.INVALID]
        removed = 0
        if invalid:
            # A damaged or foreign object would fail every engine until its TTL runs
            # out; remove it so the next store replaces it.
            log.warning("umbp-redis: %d invalid objects removed (recomputing)", len(invalid))
            # A sync load's step waits for this too: same deadline.
            removed = self.plane.delete([p.key for p in invalid], deadline=deadline)
            if removed:
                self.ledger.values_removed([p.block_hash for p in invalid])
        stuck = (
            (LoadStatus.ERROR,)
            if removed == len(invalid)
            else (LoadStatus.ERROR, LoadStatus.INVALID)
        )
        bad = [p.block_hash for p, st in zip(plans, statuses, strict=True) if st in stuck]
        self.ledger.values_failed(request_id, bad)
