"""docker-compose.yml: structure, cache settings, and the embedded kv-transfer config."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from umbp_redis.store.settings import OPTIONS_BY_NAME, RedisSettings

ROOT = Path(__file__).resolve().parent.parent


def _env_defaults(text: str) -> str:
    """Interpolate ${VAR:-default} as compose would with an empty environment."""
    text = text.replace("$$", "\0")
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)
    text = re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "required", text)
    return text.replace("\0", "$")


def compose() -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(_env_defaults((ROOT / "docker-compose.yml").read_text()))


def test_redis_is_configured_as_a_cache() -> None:
    redis = compose()["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--maxmemory-policy allkeys-lru" in cmd
    assert '--maxmemory "${UMBP_REDIS_MAXMEMORY}"' in cmd
    assert redis["environment"]["UMBP_REDIS_MAXMEMORY"] == "8gb"  # documented default
    assert '--save ""' in cmd and "--appendonly no" in cmd
    assert '${REDIS_PASSWORD:+--requirepass "$REDIS_PASSWORD"}' in cmd
    test = " ".join(redis["healthcheck"]["test"])
    assert "PONG" in test and "REDISCLI_AUTH" in redis["environment"]
    assert "ports" not in redis  # not published without a password


def test_publishing_redis_requires_a_password() -> None:
    text = (ROOT / "docker-compose.publish.yml").read_text()
    data = yaml.safe_load(text)
    assert data["services"]["redis"]["ports"]
    assert "${REDIS_PASSWORD:?" in text


def _kv_config(service: dict) -> dict:  # type: ignore[type-arg]
    arg = next(a for a in service["command"] if a.startswith("--kv-transfer-config="))
    return json.loads(arg.split("=", 1)[1])


def test_vllm_services_use_the_connector_with_real_options() -> None:
    services = compose()["services"]
    for name in ("vllm", "vllm-second"):
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["entrypoint"] == ["vllm", "serve"]
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        kv = _kv_config(svc)
        assert kv["kv_connector"] == "UMBPRedisConnector"
        assert kv["kv_connector_module_path"] == "umbp_redis.connector"
        assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert set(extra) <= set(OPTIONS_BY_NAME)
        settings = RedisSettings.from_options(extra)
        assert (settings.host, settings.port) == ("redis", 6379)
        # vLLM logs this config: the password travels in the environment instead.
        assert "password" not in extra and settings.password is None
        assert "@" not in extra["redis_url"]
        assert "UMBP_REDIS_PASSWORD" in svc["environment"]
        assert settings.ttl_seconds == 86400
    assert services["vllm-second"]["profiles"] == ["second"]


def test_image_installs_this_repository() -> None:
    svc = compose()["services"]["vllm"]
    assert svc["build"]["dockerfile"] == "docker/vllm.Dockerfile"
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert "vllm/vllm-openai" in dockerfile and "COPY umbp_redis" in dockerfile


def test_engine_image_installs_cupy_and_ships_the_kernel_source() -> None:
    text = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert "ARG CUPY_PACKAGE=cupy-cuda12x" in text and '"${CUPY_PACKAGE}>=13"' in text
    # The image checks that the installed package carries the kernel's source.
    assert "block_copy.cu" in text
    assert (ROOT / "umbp_redis" / "engine" / "copy" / "block_copy.cu").is_file()
