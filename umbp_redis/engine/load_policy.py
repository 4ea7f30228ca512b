"""Whether a hit loads while its request waits (async) or in the step that computes it."""

from __future__ import annotations

from dataclasses import dataclass

# With load_async auto, a hit expected to load in more than this share of
# sync_load_timeout_s loads async: sync, it would hold the step up that long or run out
# of time and be recomputed after all.
SYNC_LOAD_TIMEOUT_SHARE = 0.5

# Where every worker loads by layer: the largest load (bytes per worker) that runs in the
# step that computes its request (each layer waits only for its own part), instead of
# making the request wait a step or more.
LAYER_LOAD_MAX_BYTES = 128 << 20


@dataclass
class LoadPolicy:
    """Chooses async or sync for each hit, from ``load_async`` and the load's size.

    ``mode``: True or False forces async or sync; "auto" loads sync when the load moves
    at most ``sync_load_max_bytes`` per worker (its wait costs less than the engine step
    an async load keeps its request waiting), or at most ``layer_load_max_bytes`` when
    every worker loads by layer (the forward pass waits only for the layer it is at).
    Models whose failed sync loads vLLM cannot recompute (``sync_loads_possible``
    False) always load async. With "auto", a load expected to take more than
    ``SYNC_LOAD_TIMEOUT_SHARE`` of ``sync_load_timeout_s`` (a slow link) is async too.
    """

    mode: str | bool
    sync_load_max_bytes: int
    bytes_per_block: int  # one block's bytes on each worker, every layer and group
    sync_loads_possible: bool
    workers_load_by_layer: bool = False
    layer_load_max_bytes: int = LAYER_LOAD_MAX_BYTES
    sync_load_timeout_s: float = float("inf")

    def loads_async(self, blocks: int, expected_s: float | None = None) -> bool:
        """Whether a load of ``blocks`` blocks runs async; ``expected_s``: how long it is
        expected to take (None: unknown)."""
        if not self.sync_loads_possible:
            return True
        if self.mode != "auto":
            return bool(self.mode)
        if (
            expected_s is not None
            and expected_s > SYNC_LOAD_TIMEOUT_SHARE * self.sync_load_timeout_s
        ):
            return True
        limit = self.sync_load_max_bytes
        if self.workers_load_by_layer:
            limit = max(limit, self.layer_load_max_bytes)
        return blocks * self.bytes_per_block > limit
