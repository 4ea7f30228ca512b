"""The scheduler half's safety net and its checks of the engine's settings."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    from vllm.config import VllmConfig

log = logging.getLogger(__name__)
R = TypeVar("R")

# Block hash algorithms of vLLM that are not collision resistant against crafted input.
WEAK_HASH_ALGOS = ("xxhash", "xxhash_cbor")


def guarded_hook(fallback: Callable[..., Any]) -> Callable[[Callable[..., R]], Callable[..., R]]:
    """Run a hook of an object with ``errors``, ``_logged_errors`` and ``_hooks_s``; on
    any exception log it (traceback once per hook), count it and return
    ``fallback(self, *args, **kwargs)`` instead of raising into vLLM; add the hook's
    time to ``_hooks_s`` either way."""

    def wrap(fn: Callable[..., R]) -> Callable[..., R]:
        @functools.wraps(fn)
        def guarded(self: Any, *args: Any, **kwargs: Any) -> R:
            t0 = time.perf_counter()
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:
                self.errors += 1
                first = fn.__name__ not in self._logged_errors
                self._logged_errors.add(fn.__name__)
                log.error(
                    "umbp-redis: %s failed (%r); treated as a miss or a dropped store",
                    fn.__name__,
                    e,
                    exc_info=first,
                )
                return fallback(self, *args, **kwargs)  # type: ignore[no-any-return]
            finally:
                self._hooks_s += time.perf_counter() - t0

        return guarded

    return wrap


def check_engine_config(vllm_config: VllmConfig) -> None:
    """Warn about engine settings a shared cache should not run with; set the load
    failure policy to ``recompute`` (a block evicted between lookup and load must be
    recomputed, not fail the user's request)."""
    ktc = vllm_config.kv_transfer_config
    if ktc is not None and ktc.kv_load_failure_policy != "recompute":
        # vLLM reads the policy after the connector is made.
        log.warning(
            "umbp-redis: kv_transfer_config.kv_load_failure_policy was %r; using "
            "'recompute' (a block evicted from Redis between lookup and load must be "
            'recomputed, not fail the request). Set "kv_load_failure_policy": '
            '"recompute" to silence this warning',
            ktc.kv_load_failure_policy,
        )
        ktc.kv_load_failure_policy = "recompute"
    algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
    if algo in WEAK_HASH_ALGOS:
        log.warning(
            "umbp-redis: prefix_caching_hash_algo=%s is not collision resistant: in a "
            "cache shared by several tenants a crafted prompt could collide with another "
            "tenant's blocks and load their KV. Use sha256 or sha256_cbor for shared caches",
            algo,
        )
