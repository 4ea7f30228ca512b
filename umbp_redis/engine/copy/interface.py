"""The copy interface between engine KV blocks and staging slots.

The worker moves whole blocks through a ``BlockCopier``: ``gather`` (engine -> staging,
for stores) and ``scatter`` (staging -> engine, for loads) take a ``StagingCopyPlan``
and return a ``CopyHandle`` whose ``wait`` returns once the bytes have moved. Two
executors share the planner's ``KVRangeTemplate``s, so they move the same bytes:

- ``TorchBlockCopier`` (``torch_copy.py``): torch copies of strided runs, finished on
  return. Used on CPU and on CUDA when CuPy is missing.
- ``CupyBlockCopier`` (``cuda_copy.py``): one CUDA kernel launch per cache group and
  batch on a copy stream of its own, ordered after the engine's work by events.

A gather never holds up the engine: the caller keeps the source blocks from being
written (the worker keeps the scheduler's pins on them) until its handle is ``done``.
"""

from __future__ import annotations

import logging
from typing import Protocol

from umbp_redis.data import StagingCopyPlan
from umbp_redis.engine.options import ENGINE_OPTIONS_BY_NAME

log = logging.getLogger(__name__)

COPY_BACKENDS: tuple[str, ...] = ENGINE_OPTIONS_BY_NAME["copy_backend"].choices or ()


class CopyBackendUnavailable(RuntimeError):
    """The requested copy executor cannot run here (no CuPy, no CUDA, kernel build failed)."""


class CopyHandle(Protocol):
    """A copy that was started."""

    def wait(self) -> None:
        """Block until the copy has completed; raise if it failed."""

    def done(self) -> bool:
        """Whether the copy has completed, without blocking; raise if it failed."""


class BlockCopier(Protocol):
    """Moves whole blocks between the engine's KV tensors and staging slots."""

    name: str

    def engine_point(self) -> object | None:
        """A marker of the engine's work submitted so far, for ``scatter(after=...)``.

        Call it on the engine's thread. None where copies are synchronous."""

    def gather(self, plan: StagingCopyPlan) -> CopyHandle:
        """Copy the plan's engine blocks into its staging slots, after the engine's work
        submitted so far (call on the engine's thread). Later engine work does not wait
        for the copy: the source blocks must not be written until the handle is done."""

    def scatter(self, plan: StagingCopyPlan, after: object | None = None) -> CopyHandle:
        """Copy the plan's staging slots into its engine blocks, after ``after``."""

    def receive_views(self, group_id: int, block_id: int) -> list[memoryview] | None:
        """The block's object as writable views of engine memory in object order, where
        a load can receive straight into the block (host memory, no ordering needed);
        None where loads must go through staging and ``scatter``."""


class DoneHandle:
    """The handle of a copy that finished before it was returned."""

    def wait(self) -> None:
        """Nothing to wait for."""

    def done(self) -> bool:
        """Always True."""
        return True
