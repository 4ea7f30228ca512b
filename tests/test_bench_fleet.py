"""``umbp-redis bench fleet`` end to end: two real OpenAI-server engines on the tiny model,
round-robin routing, one configuration without and one with the connector; and a run
behind the vLLM project's router (``vllm-router``, kv_aware policy)."""

from __future__ import annotations

from pathlib import Path

import pytest
from helpers import run_bench_fleet, skip_without_vllm_router

# Two short conversations. A user reads each answer before the next turn: round r's
# blocks, stored eagerly after the step that computed them, are in Redis when round
# r + 1 looks them up on the other engine.
SHORT_CONVERSATIONS = (
    "--conversations", "2", "--rounds", "3", "--system-tokens", "300",
    "--user-tokens", "64", "--assistant-tokens", "100", "--think-time-s", "0.5",
)  # fmt: skip

pytestmark = pytest.mark.vllm


def test_the_fleet_bench_finds_the_other_engines_blocks_in_redis(
    tiny_model: Path, tmp_path: Path
) -> None:
    png = tmp_path / "ttft.png"
    result = run_bench_fleet(
        tiny_model,
        tmp_path,
        *SHORT_CONVERSATIONS,
        "--png",
        str(png),
    )
    runs = {r["config"]: r for r in result["runs"]}
    assert set(runs) == {"no-connector", "umbp-redis"}
    for run in runs.values():
        assert len(run["requests"]) == 6 and not any(q["error"] for q in run["requests"])
        assert all(q["ttft_s"] > 0 for q in run["requests"])
    # Round-robin: every later round lands on the other engine, which has only the
    # system prompt locally; with the connector the rest of the history comes from Redis.
    assert runs["no-connector"]["counters"].get("vllm:external_prefix_cache_hits_total", 0) == 0
    umbp = runs["umbp-redis"]
    assert umbp["counters"]["vllm:external_prefix_cache_hits_total"] > 0
    assert umbp["counters"]["vllm:umbp_blocks_loaded_total"] > 0
    assert umbp["redis_keys"] > 0 and umbp["redis_used_bytes"] > 0
    later = [q for q in umbp["requests"] if q["round_index"] > 0]
    base = [q for q in runs["no-connector"]["requests"] if q["round_index"] > 0]
    assert sum(q["cached_tokens"] for q in later) > sum(q["cached_tokens"] for q in base)
    # Round 2 (692 tokens) runs where round 0 did: locally only round 0's two full
    # blocks; the other engine's round 1 put four full blocks (512 tokens) in Redis.
    assert all(q["cached_tokens"] >= 512 for q in umbp["requests"] if q["round_index"] == 2)
    assert all(q["cached_tokens"] == 256 for q in base if q["round_index"] == 2)
    # The per-step account reached Prometheus: one lookup per new request at least.
    assert umbp["counters"]["vllm:umbp_lookup_seconds_count"] >= 6
    assert umbp["counters"]["vllm:umbp_store_cpu_seconds_count"] > 0
    # Never a wrong token: the same answers as the engines without the connector.
    assert result["summary"]["umbp-redis"]["outputs_equal_share"]["median"] == 1.0
    assert png.stat().st_size > 1000


def test_vllms_client_warms_one_engine_and_the_other_loads_its_prefixes_from_redis(
    tiny_model: Path, tmp_path: Path
) -> None:
    result = run_bench_fleet(
        tiny_model,
        tmp_path,
        "--workload",
        "vllm-prefix-repetition",
        "--prompts",
        "6",
        "--prefixes",
        "2",
        "--prefix-tokens",
        "300",
        "--suffix-tokens",
        "200",
        "--variant",
        "admit:store_after_requests=2",
    )
    runs = {r["config"]: r for r in result["runs"]}
    assert set(runs) == {"no-connector", "umbp-redis", "admit"}
    for run in runs.values():
        warm = [q for q in run["requests"] if q["round_index"] == 0]
        measured = [q for q in run["requests"] if q["round_index"] == 1]
        assert len(warm) == len(measured) == 6
        assert {q["engine"] for q in warm} == {0} and {q["engine"] for q in measured} == {1}
        assert not any(q["error"] for q in run["requests"])
        assert all(q["ttft_s"] > 0 for q in measured)
    # The counters cover the measured pass on engine 1: without the connector nothing
    # of engine 0's work reaches it; with it, every prefix's full blocks come from Redis.
    assert runs["no-connector"]["counters"].get("vllm:external_prefix_cache_hits_total", 0) == 0
    umbp = runs["umbp-redis"]
    # Each prompt is a 300-token prefix and a 200-token suffix: blocks 0-1 are the
    # prefix's, block 2 is the prompt's own. Engine 0 stored every one, so engine 1
    # loads each prefix (once at least) and each prompt's own block, and stores nothing.
    c = umbp["counters"]
    assert c["vllm:external_prefix_cache_hits_total"] >= (2 * 2 + 6) * 128
    assert c["vllm:umbp_blocks_stored_total"] == 0
    # With the admission rule engine 0 stored only the blocks two of its requests asked
    # for, the prefixes': engine 1 loads them, and each prompt's own block, asked for a
    # second time now, is computed and stored.
    c = runs["admit"]["counters"]
    assert 2 * 2 * 128 <= c["vllm:external_prefix_cache_hits_total"] <= 6 * 2 * 128
    assert c["vllm:umbp_blocks_stored_total"] == 6
    summary = result["summary"]
    assert (
        summary["umbp-redis"]["hit_tokens"]["median"]
        > summary["no-connector"]["hit_tokens"]["median"]
    )
    # Never a wrong token: engine 1's answers equal those of the engine without it.
    assert summary["umbp-redis"]["outputs_equal_share"]["median"] == 1.0
    assert summary["admit"]["outputs_equal_share"]["median"] == 1.0


def test_the_fleet_bench_runs_behind_vllm_routers_kv_aware_policy(
    tiny_model: Path, tmp_path: Path
) -> None:
    skip_without_vllm_router()
    # One configuration (the connector on) keeps the run short; the routing and the
    # engine identification are the same without it.
    result = run_bench_fleet(
        tiny_model,
        tmp_path,
        "--configs",
        "umbp-redis",
        "--router",
        "vllm-router:kv_aware",
        "--router-arg=--kv-penalty-external",
        "--router-arg=0.6",
        *SHORT_CONVERSATIONS,
    )
    runs = {r["config"]: r for r in result["runs"]}
    assert set(runs) == {"umbp-redis"}
    for run in runs.values():
        assert len(run["requests"]) == 6 and not any(q["error"] for q in run["requests"])
        # Every request went through the router and its engine was found in the logs.
        assert {q["engine"] for q in run["requests"]} <= {0, 1}
        assert all(q["request_id"] for q in run["requests"])
    for name in runs:
        log = tmp_path / "logs" / f"r0-{name}" / "router.log"
        assert "kv_aware" in log.read_text(errors="replace")
    # kv_aware sends each turn where the router's index holds its history: later rounds
    # hit more than the shared system prompt's two full blocks.
    for run in runs.values():
        later = [q for q in run["requests"] if q["round_index"] > 0]
        assert sum(q["cached_tokens"] for q in later) > 256 * len(later)
    summary = result["summary"]
    for name in runs:
        share = summary[name]["routed_away_share"]["median"]
        assert 0.0 <= share <= 1.0
        assert summary[name]["local_hit_tokens_per_request"]["median"] > 0
