"""A Redis password put in ``kv_connector_extra_config`` never reaches a log line: the
connector refuses it at startup (the error names ``password_file`` and
``UMBP_REDIS_PASSWORD``), and vLLM's own "non-default args" line, printed before any
connector exists, shows it masked. Checked on every line a real ``LLM(...)`` and a real
OpenAI server print, and on the filter's own rules."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from umbp_redis.log_redaction import MASK, ConnectorSecretFilter, connector_secrets
from umbp_redis.testing.embedded_redis import free_port

SECRET = "Zq9-never-logged-7c1"
URL_SECRET = "u7-url-secret-k2"


def _transfer_config(url: str, password: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {"redis_url": url}
    if password is not None:
        extra["password"] = password
    return {
        "kv_connector": "UMBPRedisConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def _record(msg: str, *args: object) -> logging.LogRecord:
    return logging.LogRecord("vllm.x", logging.INFO, __file__, 1, msg, args, None)


def test_the_filter_masks_both_kinds_of_password_and_keeps_every_record() -> None:
    from vllm.config import KVTransferConfig

    config = KVTransferConfig(**_transfer_config("redis://:" + URL_SECRET + "@h:6379/0", SECRET))
    record = _record("non-default args: %s", {"kv_transfer_config": config, "seed": 1})
    assert ConnectorSecretFilter().filter(record)
    line = record.getMessage()
    assert SECRET not in line and URL_SECRET not in line
    assert MASK in line and "'seed': 1" in line and "h:6379" in line
    # A dict form of the config, and a line with no config: unchanged but for the mask.
    plain = _record("args %s", {"kv_transfer_config": _transfer_config("redis://h", SECRET)})
    ConnectorSecretFilter().filter(plain)
    assert SECRET not in plain.getMessage()
    other = _record("model %s has %d layers", "m", 2)
    ConnectorSecretFilter().filter(other)
    assert other.getMessage() == "model m has 2 layers" and other.args == ("m", 2)
    assert connector_secrets({"kv_connector_extra_config": {"redis_url": "redis://h"}}) == set()
    in_query = {"redis_url": "redis://h:1/0?password=q%2Fw&db=0"}
    assert connector_secrets({"kv_connector_extra_config": in_query}) == {"q/w", "q%2Fw"}


_LLM_SCRIPT = """
import json, sys
if __name__ == "__main__":
    from vllm import LLM
    try:
        LLM(model=sys.argv[1], max_model_len=256, enforce_eager=True,
            kv_transfer_config=json.loads(sys.argv[2]))
    except Exception as e:
        print("startup failed:", type(e).__name__)
        sys.exit(3)
    sys.exit(0)
"""


def _engine_env() -> dict[str, str]:
    return {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "UMBP_REDIS_PASSWORD": ""}


@pytest.mark.vllm
def test_a_password_in_the_config_is_refused_and_in_no_line_llm_or_server_prints(
    tiny_model: Path, redis_url: str, tmp_path: Path
) -> None:
    host_port = redis_url.split("//", 1)[1]
    configs = {
        "llm": _transfer_config(redis_url, SECRET),
        "server": _transfer_config(f"redis://:{URL_SECRET}@{host_port}", None),
    }
    script = tmp_path / "llm_with_secret.py"
    script.write_text(_LLM_SCRIPT)
    # Both start at once: each fails at the connector's construction.
    procs = {
        "llm": subprocess.Popen(
            [sys.executable, str(script), str(tiny_model), json.dumps(configs["llm"])],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_engine_env(),
        ),
        "server": subprocess.Popen(
            [
                sys.executable,
                "-m",
                "vllm.entrypoints.openai.api_server",
                "--model",
                str(tiny_model),
                "--max-model-len",
                "256",
                "--enforce-eager",
                "--port",
                str(free_port()),
                "--kv-transfer-config",
                json.dumps(configs["server"]),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=_engine_env(),
        ),
    }
    printed = {name: p.communicate(timeout=300)[0] for name, p in procs.items()}
    for name, p in procs.items():
        out = printed[name]
        assert p.returncode != 0, (name, out[-2000:])
        # The startup fails with the connector's error, which names the safe places.
        assert "password_file" in out and "UMBP_REDIS_PASSWORD" in out, (name, out[-3000:])
        # vLLM printed its arguments, the transfer config among them, masked.
        args_lines = [line for line in out.splitlines() if "non-default args" in line]
        assert args_lines and all(MASK in line for line in args_lines), (name, args_lines)
        leaked = [line for line in out.splitlines() if SECRET in line or URL_SECRET in line]
        assert leaked == [], (name, leaked)
