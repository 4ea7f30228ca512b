"""The engine's options: one typed, frozen ``EngineOptions`` beside the store's
``RedisSettings``, both parsed once from ``kv_connector_extra_config``
(``parse_connector_options``).

The table below is the engine's half of the option surface (the store's is in
``umbp_redis.store.settings``); ``docs/configuration.md`` is generated from both.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from umbp_redis.store.errors import ConfigError
from umbp_redis.store.settings import (
    REDIS_OPTIONS,
    MiB,
    Option,
    RedisSettings,
    refuse_secrets,
    validate_options,
)

ENGINE_OPTIONS: tuple[Option, ...] = (
    Option(
        "key_namespace",
        (str, type(None)),
        None,
        "Explicit key namespace; when unset it is derived from the model and cache layout.",
    ),
    Option(
        "weights_fingerprint",
        str,
        "sampled",
        "How the derived namespace covers the weights: sampled (names, sizes and 16 "
        "sampled 64 KiB windows of each weight file; the hub commit for hub models), full "
        "(every byte: slow for large models) or off (path, revision and config only).",
        choices=("sampled", "full", "off"),
    ),
    Option(
        "lookup_async",
        bool,
        False,
        "Run lookups off the scheduler thread; the request is asked about again until the "
        "answer is in.",
    ),
    Option(
        "load_async",
        (str, bool),
        "auto",
        "true: load hits off the forward pass (the request waits for its load); false: "
        "load them before the step's forward pass; auto: false for loads of at most "
        "sync_load_max_bytes, true for larger ones and for loads expected to take more "
        "than half of sync_load_timeout_s. Models with several KV cache groups (hybrid) "
        "always load async.",
        choices=("auto", True, False),
    ),
    Option(
        "sync_load_max_bytes",
        int,
        8 * MiB,
        "With load_async auto: the largest load (bytes per worker) that runs before the "
        "step instead of making its request wait a step or more.",
        minimum=0,
    ),
    Option(
        "sync_load_timeout_s",
        (int, float),
        0.5,
        "The longest a sync load may hold up the engine's step (removing invalid "
        "values it found included); blocks not loaded by then are recomputed (an async "
        "load waits op_timeout_s per round trip instead, without holding up the step).",
        minimum=0.001,
    ),
    Option(
        "decline_slow_loads",
        bool,
        True,
        "Offer a hit only when its load is expected to finish before computing its tokens "
        "would: both estimated from this engine's own loads (bytes and seconds) and steps "
        "(tokens and seconds); until both are known every hit loads. false: load every hit.",
    ),
    Option(
        "save_decode_cache",
        bool,
        False,
        "Also store blocks completed by generated tokens, not only prompt blocks.",
    ),
    Option(
        "store_mode",
        str,
        "eager",
        "When blocks are written to Redis: eager (each complete prompt block right after "
        "the step that computed it) or lazy (only when vLLM is about to evict it from its "
        "own prefix cache: blocks near the head of vLLM's free queue are pinned until "
        "stored, so blocks vLLM never evicts cost no Redis bandwidth).",
        choices=("eager", "lazy"),
    ),
    Option(
        "store_after_requests",
        int,
        1,
        "Store a prompt block only once this many requests anywhere in the fleet asked for "
        "its prefix (1: every block is stored). Each request's lookup counts itself in "
        "Redis, in the same round trip, against every block of its prompt (one small key "
        "per block, kept for ttl_seconds); 2 keeps single-use prompt tails out of a Redis "
        "smaller than the working set, at the cost of a block's first reuse elsewhere. "
        "Above 1 it needs lookups (kv_role kv_both).",
        minimum=1,
    ),
    Option(
        "max_staging_bytes",
        int,
        256 * MiB,
        "Host staging memory per worker; stores that do not fit are dropped and counted. "
        "Pinned (GPU) staging uses the largest power of two not above it. Startup fails "
        "when it holds less than one object (the error gives the object size).",
        minimum=1,
    ),
    Option(
        "copy_backend",
        str,
        "auto",
        "How blocks move between the KV cache and staging: auto (the CuPy kernel for CUDA "
        "tensors when CuPy is installed, else torch copies), cupy (the kernel; startup fails "
        "where it cannot run) or torch (torch copies, the CPU path).",
        choices=("auto", "cupy", "torch"),
    ),
    Option(
        "load_failure_quarantine_s",
        (int, float),
        300.0,
        "A block whose load failed (invalid value, error reply) is not offered as a hit "
        "again for this long, so one bad object does not cost a failed load per request "
        "(0: no quarantine). At most 65536 blocks are remembered.",
        minimum=0.0,
    ),
    Option(
        "fleet_events",
        bool,
        True,
        "With vLLM's --kv-events-config: this engine's KV events also announce the blocks "
        "the namespace's other engines stored in Redis (any engine can load them), read "
        "from the namespace's announcement stream, and its own go to that stream, so a "
        "router credits every engine with every block in Redis. false: only this "
        "engine's own stores.",
    ),
)
ENGINE_OPTIONS_BY_NAME = {o.name: o for o in ENGINE_OPTIONS}
# Every option of kv_connector_extra_config, the store's first.
CONNECTOR_OPTIONS: tuple[Option, ...] = REDIS_OPTIONS + ENGINE_OPTIONS

# Options no longer taken, and what to use instead (named in the startup error).
REMOVED_OPTIONS: dict[str, str] = {
    "enable_lookup": (
        'kv_transfer_config\'s "kv_role": "kv_producer" stores without looking up, '
        '"kv_consumer" looks up and loads without storing'
    ),
    "load_by_layer": (
        "nothing: a sync load runs alongside the forward pass wherever the engine allows "
        "it (host KV caches, values in parts); load_async and sync_load_max_bytes choose "
        "how hits load"
    ),
    "layer_load_max_bytes": (
        "nothing: where every worker loads by layer, loads of up to 128 MiB per worker run "
        "in the step that computes their request"
    ),
    "gil_switch_interval_ms": (
        "nothing: the worker shortens Python's switch interval to 0.2 ms while loads are in flight"
    ),
    "idle_wait_ms": (
        "nothing: the scheduler waits 1 ms in a step with nothing to compute but loads in flight"
    ),
    "transfer_cpus": (
        "nothing: transfer threads run on every CPU of the worker's NUMA node no other "
        "rank's forward pass is bound to"
    ),
    "max_inflight_bytes": "nothing: each connection keeps at most 1 MiB of replies unread",
    "store_report_timeout_s": (
        "nothing: blocks of a store whose report never comes are released after 120 s "
        "(vllm:umbp_stale_pins_released_total counts them)"
    ),
    "shutdown_timeout_s": (
        "nothing: shutdown waits up to 5 s for transfers in flight (each is bounded by "
        "op_timeout_s)"
    ),
}


def _default(name: str) -> Any:
    return dataclasses.field(default=ENGINE_OPTIONS_BY_NAME[name].default)


@dataclass(frozen=True)
class EngineOptions:
    """The engine's options, typed; defaults come from the option table."""

    key_namespace: str | None = _default("key_namespace")
    weights_fingerprint: str = _default("weights_fingerprint")
    lookup_async: bool = _default("lookup_async")
    load_async: str | bool = _default("load_async")  # "auto", True or False
    sync_load_max_bytes: int = _default("sync_load_max_bytes")
    sync_load_timeout_s: float = _default("sync_load_timeout_s")
    decline_slow_loads: bool = _default("decline_slow_loads")
    save_decode_cache: bool = _default("save_decode_cache")
    store_mode: str = _default("store_mode")
    store_after_requests: int = _default("store_after_requests")
    max_staging_bytes: int = _default("max_staging_bytes")
    copy_backend: str = _default("copy_backend")
    load_failure_quarantine_s: float = _default("load_failure_quarantine_s")
    fleet_events: bool = _default("fleet_events")

    @classmethod
    def from_options(cls, extra: Mapping[str, Any] | None) -> EngineOptions:
        """The engine's options of ``kv_connector_extra_config`` (other keys are the
        store's); ``ConfigError`` naming the key on a bad value."""
        opts = validate_options(extra, allowed=ENGINE_OPTIONS, ignore_unknown=True)
        return cls(**opts)


def parse_connector_options(
    extra: Mapping[str, Any] | None,
) -> tuple[RedisSettings, EngineOptions]:
    """Both halves of ``kv_connector_extra_config``, validated once: an unknown key, a
    removed one (with what replaced it), a password (``refuse_secrets``) or a bad value
    raises ``ConfigError``."""
    extra = dict(extra or {})
    for name, instead in REMOVED_OPTIONS.items():
        if name in extra:
            raise ConfigError(
                f"kv_connector_extra_config[{name!r}] is no longer an option: use {instead}"
            )
    refuse_secrets(extra)
    validate_options(extra, allowed=CONNECTOR_OPTIONS)  # unknown keys
    return RedisSettings.from_options(extra), EngineOptions.from_options(extra)
