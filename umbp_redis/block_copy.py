"""The copy interface between engine KV blocks and staging slots, and its selection.

The worker moves whole blocks through a ``BlockCopier``: ``gather`` (engine -> staging,
for stores) and ``scatter`` (staging -> engine, for loads) take a ``StagingCopyPlan``
and return a ``CopyHandle`` whose ``wait`` returns once the bytes have moved. Two
executors share the planner's ``KVRangeTemplate``s, so they move the same bytes:

- ``TorchBlockCopier`` (``cpu_copy.py``): torch copies of strided runs, finished on
  return. Used on CPU and on CUDA when CuPy is missing.
- ``CupyBlockCopier`` (``gpu_copy.py``): one CUDA kernel launch per cache group and
  batch on a copy stream of its own, ordered after the engine's work by events.

A gather never holds up the engine: the caller keeps the source blocks from being
written (the worker keeps the scheduler's pins on them) until its handle is ``done``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Protocol

import torch

from umbp_redis.config import OPTIONS_BY_NAME
from umbp_redis.data import KVRangeTemplate, StagingCopyPlan
from umbp_redis.errors import ConfigError
from umbp_redis.staging import StagingPool

log = logging.getLogger(__name__)

COPY_BACKENDS: tuple[str, ...] = OPTIONS_BY_NAME["copy_backend"].choices or ()


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


class DoneHandle:
    """The handle of a copy that finished before it was returned."""

    def wait(self) -> None:
        """Nothing to wait for."""

    def done(self) -> bool:
        """Always True."""
        return True


def make_block_copier(
    backend: str,
    kv_caches: Mapping[str, torch.Tensor],
    templates: Mapping[int, KVRangeTemplate],
    staging: StagingPool,
    num_blocks: int,
) -> BlockCopier:
    """The executor for ``backend`` (``auto``, ``cupy`` or ``torch``) over these tensors.

    ``auto`` takes the CuPy kernel for CUDA tensors when it can be built and torch
    copies otherwise (with a warning on CUDA). ``cupy`` raises ``ConfigError`` naming
    the option when the kernel cannot run here.
    """
    from umbp_redis.cpu_copy import TorchBlockCopier

    if backend not in COPY_BACKENDS:
        raise ConfigError(
            f"kv_connector_extra_config['copy_backend'] must be one of {list(COPY_BACKENDS)}, "
            f"got {backend!r}"
        )
    devices = {t.device for t in kv_caches.values()}
    on_cuda = any(d.type == "cuda" for d in devices)
    if backend == "torch" or (backend == "auto" and not on_cuda):
        return TorchBlockCopier(kv_caches, templates, staging, num_blocks)
    try:
        if not on_cuda:
            raise CopyBackendUnavailable(
                f"the KV cache is on {sorted(str(d) for d in devices)}, not a CUDA device"
            )
        from umbp_redis.gpu_copy import CupyBlockCopier

        return CupyBlockCopier(kv_caches, templates, staging, num_blocks)
    except CopyBackendUnavailable as e:
        if backend == "cupy":
            raise ConfigError(
                f"kv_connector_extra_config['copy_backend'] is 'cupy' but {e}; use 'auto' or "
                "'torch', or install CuPy (pip install 'umbp-redis[cuda]')"
            ) from None
        log.warning(
            "umbp-redis: GPU copy kernel unavailable (%s); using torch copies, "
            "which are much slower. Install CuPy: pip install 'umbp-redis[cuda]'",
            e,
        )
        return TorchBlockCopier(kv_caches, templates, staging, num_blocks)
