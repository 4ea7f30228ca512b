"""Compatibility namespaces: what an engine digests to share objects only with
engines that would compute the same bytes. No I/O: the weights fingerprint is read by
the caller (``umbp_redis.engine.weights``) and passed in."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from umbp_redis.data.keys import KEY_PREFIX, NAMESPACE_RE
from umbp_redis.data.parts import SPLIT_RULE

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec


CONNECTOR_NAME = "UMBPRedisConnector"


def _stable(value: Any) -> Any:
    """A JSON-able, order-stable rendering of config values (dtypes, enums, tuples)."""
    if isinstance(value, Mapping):
        return {str(k): _stable(v) for k, v in sorted(value.items(), key=lambda kv: str(kv[0]))}
    if isinstance(value, list | tuple | set | frozenset):
        items = [_stable(v) for v in value]
        return sorted(items, key=repr) if isinstance(value, set | frozenset) else items
    if isinstance(value, bool | int | float | str) or value is None:
        return value
    if isinstance(value, torch.dtype):
        return str(value)
    if hasattr(value, "value") and hasattr(value, "name"):  # enums
        return f"{type(value).__name__}.{value.name}"
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return _spec_fingerprint(value)
    return repr(value)


def layer_specs(group: KVCacheGroupSpec) -> dict[str, KVCacheSpec]:
    """Map each layer of a cache group to the spec describing its own pages."""
    spec = group.kv_cache_spec
    per_layer = getattr(spec, "kv_cache_specs", None)
    if isinstance(per_layer, Mapping):
        return {name: per_layer[name] for name in group.layer_names}
    return {name: spec for name in group.layer_names}


def _spec_fingerprint(spec: Any) -> dict[str, Any]:
    """Every field that shapes a layer's stored bytes, in a stable form."""
    out: dict[str, Any] = {"kind": type(spec).__name__}
    for f in dataclasses.fields(spec):
        out[f.name] = _stable(getattr(spec, f.name))
    return out


def _model_fingerprint(model_config: Any) -> dict[str, Any]:
    """Effective model settings that change the KV a checkpoint produces.

    ``hf_config`` already has ``hf_overrides`` applied, so overridden RoPE or attention
    settings separate engines that share a model path.
    """
    hf_config = model_config.hf_config
    hf = hf_config.to_dict() if hf_config is not None and hasattr(hf_config, "to_dict") else {}
    for noisy in ("_name_or_path", "transformers_version", "_commit_hash", "architectures_map"):
        hf.pop(noisy, None)
    return {
        "model": model_config.model,
        "revision": model_config.revision,
        "dtype": _stable(model_config.dtype),
        "quantization": _stable(model_config.quantization),
        "hf_config": _stable(hf),
    }


def _engine_may_load_foreign_kv(vllm_config: VllmConfig) -> bool:
    """Whether another connector of this engine may load KV vLLM's cache writer did not make.

    A MultiConnector hands each child a copy of the config holding only that child's
    ``kv_transfer_config``, so the engine's current config is read too when it is set.
    """
    from vllm.config import get_current_vllm_config_or_none

    configs = [vllm_config]
    current = get_current_vllm_config_or_none()
    if current is not None:
        configs.append(current)
    for cfg in configs:
        ktc = cfg.kv_transfer_config
        if ktc is None or ktc.kv_connector != "MultiConnector":
            continue
        children = (ktc.kv_connector_extra_config or {}).get("connectors", [])
        for child in children:
            name = child.get("kv_connector") if isinstance(child, Mapping) else None
            role = child.get("kv_role", ktc.kv_role) if isinstance(child, Mapping) else None
            if name != CONNECTOR_NAME and role in ("kv_consumer", "kv_both"):
                return True
    return False


def namespace_inputs(
    vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
) -> dict[str, Any]:
    """Everything the derived namespace digests, as a JSON-able dict (for logs and docs).

    ``weights`` is the weights fingerprint the caller read (``umbp_redis.engine.weights``):
    reading files is I/O, which this module does not do.
    """
    pc = vllm_config.parallel_config
    cc = vllm_config.cache_config
    groups = []
    for gid, group in enumerate(kv_cache_config.kv_cache_groups):
        groups.append(
            {
                "group": gid,
                "layers": {name: _spec_fingerprint(s) for name, s in layer_specs(group).items()},
            }
        )
    return {
        "schema": KEY_PREFIX,
        "object_parts": SPLIT_RULE,
        "model": _model_fingerprint(vllm_config.model_config),
        "weights": weights,
        "block_hash_algo": str(cc.prefix_caching_hash_algo),
        "cache_dtype": str(cc.cache_dtype),
        "kv_cache_layout": kv_cache_config.kv_cache_layout,
        "hash_block_size": kv_cache_config.hash_block_size,
        "groups": groups,
        "parallel": {
            "tp": int(pc.tensor_parallel_size),
            "pp": int(pc.pipeline_parallel_size),
            "pcp": int(pc.prefill_context_parallel_size),
            "dcp": int(pc.decode_context_parallel_size),
        },
        "foreign_kv": _engine_may_load_foreign_kv(vllm_config),
    }


@dataclass(frozen=True)
class UMBPNamespace:
    """Compatibility namespace of stored objects: engines share objects only within one.

    ``value`` is either the operator's explicit ``key_namespace`` or a 16-hex-digit
    digest of everything that changes the bytes an engine would store.
    """

    value: str
    derived: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.value, str) or not NAMESPACE_RE.match(self.value):
            raise ValueError(
                "key_namespace must be 1-64 characters of letters, digits, '_', '.' or '-' "
                f"(no ':'), got {self.value!r}"
            )

    def __str__(self) -> str:
        return self.value

    @classmethod
    def configured(cls, vllm_config: VllmConfig) -> UMBPNamespace | None:
        """Return the explicit ``key_namespace`` of the connector config, or None when derived."""
        ktc = vllm_config.kv_transfer_config
        extra = (ktc.kv_connector_extra_config or {}) if ktc else {}
        value = extra.get("key_namespace")
        if value in (None, ""):
            return None
        return cls(value=value, derived=False)

    @classmethod
    def from_vllm_config(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
    ) -> UMBPNamespace:
        """Derive the namespace from a worker's per-layer KV cache config.

        The same inputs give the same value in every process; any change in one of
        them (model settings, revision, weights fingerprint, block hash algorithm,
        specs, layout, parallel sizes, foreign KV) gives another. The scheduler's config
        flattens some spec groups, so the scheduler adopts what its workers report
        rather than deriving its own.
        """
        inputs = namespace_inputs(vllm_config, kv_cache_config, weights)
        blob = json.dumps(inputs, sort_keys=True)
        return cls(value=hashlib.sha256(blob.encode()).hexdigest()[:16], derived=True)

    @classmethod
    def resolve(
        cls, vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, weights: str | None = None
    ) -> UMBPNamespace:
        """The configured namespace if there is one, else the derived one."""
        return cls.configured(vllm_config) or cls.from_vllm_config(
            vllm_config, kv_cache_config, weights
        )
