"""Choosing the copy executor for the engine's KV tensors (option ``copy_backend``)."""

from __future__ import annotations

import logging
from collections.abc import Mapping

import torch

from umbp_redis.data import KVRangeTemplate
from umbp_redis.engine.copy.interface import COPY_BACKENDS, BlockCopier, CopyBackendUnavailable
from umbp_redis.engine.staging import StagingPool
from umbp_redis.store.errors import ConfigError

log = logging.getLogger(__name__)


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
    from umbp_redis.engine.copy.torch_copy import TorchBlockCopier

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
        from umbp_redis.engine.copy.cuda_copy import CupyBlockCopier

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
