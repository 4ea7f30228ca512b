"""A step's sync loads by layer: started before the forward pass, waited for layer by
layer during it, joined after it.

Values stored in parts (a few layers each) are read part by part straight into the KV
cache while the forward pass runs; before each attention layer vLLM calls
``wait_for_layer_load``, which waits on the load's ``LayerGate`` for that layer's part of
every block, at most until the load's deadline. After the forward pass the step joins
its loads: one that did not end, or one some layer of which the forward pass did not
wait for, fails all its blocks (vLLM recomputes them). A forward pass that skipped a
wait turns loads by layer off for the process.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from typing import Any

from umbp_redis.data import BlockLoadBatch
from umbp_redis.engine.layer_gate import LayerGate

log = logging.getLogger(__name__)

# Seconds past a load-by-layer's deadline the end of the step waits for its thread.
LAYER_LOAD_JOIN_GRACE_S = 1.0


class LayerLoads:
    """One worker's loads by layer: which layer is in which part, and this step's gates."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s  # sync_load_timeout_s: each load's deadline
        self.enabled = True  # off once a forward pass skipped a layer's wait
        self.turned_off = False  # since the scheduler last heard (take_turned_off)
        self.layer_part: dict[str, tuple[int, int]] = {}  # layer -> (group, part)
        self.part_count: dict[int, int] = {}  # by cache group
        self.gates: list[tuple[LayerGate, Future[Any], BlockLoadBatch]] = []
        self._wait_logged = False

    def in_parts(self, batch: BlockLoadBatch) -> bool:
        """Whether some group of ``batch`` stores its values in several parts."""
        return any(self.part_count.get(g, 1) > 1 for g in set(batch.group_ids))

    def start(self, batch: BlockLoadBatch, submit: Callable[[LayerGate], Future[Any]]) -> None:
        """Start ``batch``'s load by layer (``submit(gate)`` runs it on a thread)."""
        groups: dict[int, int] = defaultdict(int)
        for g in batch.group_ids:
            groups[g] += 1
        gate = LayerGate(groups, time.monotonic() + self.timeout_s)
        self.gates.append((gate, submit(gate), batch))

    def wait(self, layer_name: str) -> float:
        """Wait until this step's loads have ``layer_name``'s part of every block, at most
        until their deadlines; the seconds waited."""
        where = self.layer_part.get(layer_name)
        if not self.gates or where is None:  # no load by layer, or a layer none writes
            return 0.0
        t0 = time.perf_counter()
        for gate, _fut, _batch in self.gates:
            if not gate.wait(*where) and not self._wait_logged:
                self._wait_logged = True
                log.warning(
                    "umbp-redis: a sync load had not brought layer %s in by "
                    "sync_load_timeout_s=%.3g; its blocks are recomputed (logged once)",
                    layer_name,
                    self.timeout_s,
                )
        return time.perf_counter() - t0

    def join(self, load_failed: Callable[[str, Iterable[int]], None]) -> float:
        """End of the forward pass: wait for this step's loads to end (each by its
        deadline, plus a grace); ``load_failed(request_id, block_ids)`` for a load that
        did not end or whose layers were not all waited for. The seconds waited."""
        gates, self.gates = self.gates, []
        t0 = time.perf_counter()
        for gate, fut, batch in gates:
            try:
                fut.result(
                    timeout=max(0.0, gate.deadline - time.monotonic()) + LAYER_LOAD_JOIN_GRACE_S
                )
            except Exception as e:
                log.error("umbp-redis: sync load of %s did not end: %r", batch.request_id, e)
                load_failed(batch.request_id, batch.block_ids)
                continue
            parts = {(g, p) for g in set(batch.group_ids) for p in range(self.part_count.get(g, 0))}
            unwaited = parts - gate.waited
            if not unwaited:
                continue
            # The forward pass may have read those layers before their bytes were in.
            load_failed(batch.request_id, batch.block_ids)
            if self.enabled:
                self.enabled = False
                self.turned_off = True
                log.warning(
                    "umbp-redis: the forward pass did not wait for every layer of a load by "
                    "layer (not waited: %s); its blocks are recomputed and sync loads now run "
                    "before the forward pass",
                    sorted(unwaited),
                )
        return time.perf_counter() - t0 if gates else 0.0

    def take_turned_off(self) -> bool:
        """Whether loads by layer were turned off since the last call."""
        off, self.turned_off = self.turned_off, False
        return off
