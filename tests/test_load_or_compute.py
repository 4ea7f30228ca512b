"""Load only what beats computing: real vLLM engines (CPU, the tiny model) against one
real redis-server reached over a fast way (a unix socket) and a slow one (TCP over a
rate-limited veth link, ``umbp_redis.testing.slow_link``).

* Over the fast way a fresh engine loads its hits and declines none.
* Over the slow link a fresh engine loads its first hits (nothing learned yet), then
  declines them: they are computed, with the same tokens as an engine without the
  connector.

How much time that saves is a benchmark's business (``umbp_redis/bench/warm_ttft.py
--link-mbit``, docs/performance.md), not a test's.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import PROMPTS, connector, run_engine, tokens

from umbp_redis.testing.slow_link import NetworkSetupError, SlowLinkRedis, slow_link_redis
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm

# 8 Mbit/s: a hit of 3 tiny-model blocks (3 x 128 KiB) takes about 0.4 s to load; the
# tiny model computes its 384 tokens in about 10 ms.
RATE_MBIT = 8


def _others(seed: int) -> list[str]:
    """Prompts of other lengths than PROMPTS, none of them in Redis: steps of many sizes
    for the scheduler's estimate of what a token costs to compute."""
    return [sample_prompts(1, w, seed=seed + w)[0] for w in (40, 160, 320, 640)]


@pytest.fixture(scope="module")
def link() -> Iterator[SlowLinkRedis]:
    try:
        with slow_link_redis(RATE_MBIT) as s:
            yield s
    except NetworkSetupError as e:
        pytest.skip(f"no rate-limited link to a server here: {e}")


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("load_or_compute")


def _phases(prefix: str, seed: int) -> list[dict[str, Any]]:
    """Prompts of many sizes one at a time (a prefill step, then decode steps), then
    PROMPTS twice, each time from Redis (the local cache reset)."""
    others = [
        {"op": "generate", "name": f"{prefix}_other{i}", "prompts": [p]}
        for i, p in enumerate(_others(seed))
    ]
    return [
        *others,
        {"op": "reset"},
        {"op": "generate", "name": f"{prefix}_first"},
        # One request alone: where the first loads ran out of sync_load_timeout_s, its
        # hit is a probe (one block, async) that measures the link whole.
        {"op": "reset"},
        {"op": "generate", "name": f"{prefix}_one", "prompts": PROMPTS[:1]},
        {"op": "reset"},
        {"op": "generate", "name": f"{prefix}_second"},
        {"op": "scheduler_counters", "name": f"{prefix}_counters"},
    ]


@pytest.fixture(scope="module")
def runs(work: Path, tiny_model: Path, link: SlowLinkRedis) -> dict[str, Any]:
    base = run_engine(
        work,
        "baseline",
        tiny_model,
        None,
        [{"op": "generate", "name": "g"}],
    )
    # The fast engine computes PROMPTS first and stores them (it is the one that
    # fills Redis), then loads them as a fresh engine would.
    fast_phases = [{"op": "generate", "name": "fast_cold"}, *_phases("fast", 40)]
    fast = run_engine(
        work,
        "fast",
        tiny_model,
        connector(link.fast_url),
        fast_phases,
    )
    # A consumer: it stores nothing, so only its lookups and loads cross the slow link
    # (stores in flight there would slow its lookups and pin blocks it resets).
    consumer = {
        **connector(link.slow_url),
        "kv_role": "kv_consumer",
    }
    slow = run_engine(
        work,
        "slow",
        tiny_model,
        consumer,
        _phases("slow", 90),
    )
    return {"base": base["g"], **fast, **slow}


def _from_redis(runs: dict[str, Any], name: str) -> int:
    """Prompt tokens phase ``name`` took from Redis: its cached tokens beyond those of the
    engine without the connector (local hits among the batch's shared prefix)."""
    cached = [o["cached"] for o in runs[name]["outputs"]]
    return sum(cached) - sum(o["cached"] for o in runs["base"]["outputs"])


def test_a_fast_way_loads_every_hit(runs: dict[str, Any]) -> None:
    for name in ("fast_cold", "fast_first", "fast_second"):
        assert tokens(runs[name]) == tokens(runs["base"]), name
    assert _from_redis(runs, "fast_first") > 0 and _from_redis(runs, "fast_second") > 0
    c = runs["fast_counters"]
    assert c["loads_declined"] == 0 and c["tokens_declined"] == 0
    # A sync load that ran out of its time (a busy machine) starts the load line anew
    # (None) until a load completes again; where it is known, loading wins.
    if c["expected_load_s"] is not None:
        assert c["expected_load_s"] < c["expected_compute_s"]


def test_a_slow_link_learns_that_loading_loses_and_computes_instead(
    runs: dict[str, Any],
) -> None:
    for name in ("slow_first", "slow_second"):
        assert tokens(runs[name]) == tokens(runs["base"]), name
    assert tokens(runs["slow_one"]) == tokens(runs["base"])[:1]
    # Nothing learned yet: the first hits load (or run out of sync_load_timeout_s, and
    # the next one is a probe: either way the engine learns what a load costs here).
    c = runs["slow_counters"]
    assert c["expected_load_s"] > c["expected_compute_s"]
    # Then hits are declined: computed, not loaded (a probe may load one block of one).
    assert c["loads_declined"] >= len(PROMPTS) - 1
    assert c["tokens_declined"] >= c["loads_declined"] * 128
    assert _from_redis(runs, "slow_second") <= 128 * c["load_probes"]
    assert _from_redis(runs, "slow_second") < _from_redis(runs, "fast_second")
