"""The fleet benchmark's logic: conversation scripts, routers, summaries (no engines)."""

from __future__ import annotations

import math

import pytest

from umbp_redis.ops.bench_fleet import (
    ConfigRun,
    RequestRecord,
    build_configs,
    format_table,
    ideal_block_count,
    parse_variant,
    repetition_ideal_block_count,
    summarize,
    workload_title,
)
from umbp_redis.ops.fleet_engines import parse_prometheus
from umbp_redis.ops.fleet_vllm_client import client_arguments, requests_of
from umbp_redis.ops.fleet_workload import (
    ConversationScript,
    ConversationShape,
    LatencySummary,
    RepetitionShape,
    Router,
    percentile,
    share_of_ideal_gain,
)


def test_conversations_share_the_system_prompt_and_grow_their_own_history() -> None:
    shape = ConversationShape(
        conversations=3,
        rounds=4,
        system_tokens=50,
        user_tokens=7,
        assistant_tokens=11,
        vocab_size=100,
    )
    script = ConversationScript(shape)
    first = [script.turn(c, 0).prompt for c in range(3)]
    assert all(p[:50] == first[0][:50] for p in first)  # one shared system prompt
    assert len({p[50:] for p in first}) == 3  # each conversation's own user turn
    for c in range(3):
        for r in range(1, 4):
            prev, cur = script.turn(c, r - 1).prompt, script.turn(c, r).prompt
            assert cur[: len(prev)] == prev  # history is kept, the new turn appended
            assert len(cur) == shape.prompt_tokens(r)
    assert all(3 <= t < 100 for t in script.turn(2, 3).prompt)
    again = ConversationScript(shape)  # deterministic for its shape
    assert again.turn(1, 2) == script.turn(1, 2)
    other = ConversationScript(ConversationShape(**{**shape.__dict__, "seed": 8}))
    assert other.turn(1, 2) != script.turn(1, 2)


def test_shape_rejects_what_cannot_run() -> None:
    with pytest.raises(ValueError, match="rounds"):
        ConversationShape(rounds=0).validate()
    with pytest.raises(ValueError, match="vocab_size"):
        ConversationShape(vocab_size=4).validate()


def test_routers() -> None:
    rr = Router("round-robin", 2)
    assert [rr.engine_for(0, r) for r in range(4)] == [0, 1, 0, 1]
    assert [rr.engine_for(1, r) for r in range(4)] == [1, 0, 1, 0]
    sticky = Router("sticky", 3)
    assert {sticky.engine_for(4, r) for r in range(6)} == {1}
    # least-loaded: the fewest in flight, ties as round-robin would pick.
    ll = Router("least-loaded", 3)
    assert ll.engine_for(0, 1, [2, 0, 1]) == 1
    assert ll.engine_for(0, 1, [1, 1, 1]) == 1  # a tie: round-robin's engine
    assert ll.engine_for(2, 2, [0, 1, 0]) == 2  # tied 0 and 2: counting from (2+2)%3 = 1
    with pytest.raises(ValueError):
        ll.engine_for(0, 0, [0, 0])
    rnd = Router("random", 2)
    picks = [rnd.engine_for(c, r) for c in range(8) for r in range(6)]
    assert picks == [Router("random", 2).engine_for(c, r) for c in range(8) for r in range(6)]
    assert set(picks) == {0, 1}
    with pytest.raises(ValueError, match="router must be one of"):
        Router("nearest", 2)


def test_percentiles_and_the_share_of_the_ideal_gain() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile([5.0], 99) == 5.0
    s = LatencySummary.of([0.1, 0.2, 0.3])
    assert s.count == 3 and abs(s.mean - 0.2) < 1e-12 and s.p50 == 0.2
    assert math.isnan(LatencySummary.of([]).mean)
    assert share_of_ideal_gain(1.0, 0.55, 0.5) == pytest.approx(0.9)
    assert share_of_ideal_gain(1.0, 1.2, 0.5) == pytest.approx(-0.4)  # slower than none
    assert math.isnan(share_of_ideal_gain(1.0, 0.8, 1.0))


def test_configs_variants_and_the_ideal_cache_size() -> None:
    names = [
        c.name
        for c in build_configs(
            "round-robin",
            24,
            96,
            small_redis=True,
            variants=[parse_variant("gil:sync_load_max_bytes=0")],
        )
    ]
    assert names == [
        "no-connector",
        "umbp-redis",
        "ideal",
        "sticky",
        "sticky-umbp",
        "small-redis",
        "gil",
    ]
    v = parse_variant(
        "x@sticky:load_async=true,store_mode=lazy,env.PYTHONPATH=/a,ktc.kv_role=kv_consumer"
    )
    assert (v.name, v.router) == ("x", "sticky")
    assert v.options == {"load_async": True, "store_mode": "lazy"}
    assert v.env == {"PYTHONPATH": "/a"} and v.transfer_fields == {"kv_role": "kv_consumer"}
    sticky = build_configs("round-robin", 24, 96, variants=[v])[-1]
    assert sticky.router == "sticky" and sticky.engine_env == (("PYTHONPATH", "/a"),)
    admit = build_configs(
        "round-robin",
        24,
        96,
        variants=[parse_variant("a:store_after_requests=2,redis.maxmemory_share=0.5")],
    )[-1]
    assert admit.connector_options == (("store_after_requests", 2),)
    assert admit.redis_maxmemory_share == 0.5
    with pytest.raises(ValueError, match="maxmemory_share"):
        parse_variant("a:redis.maxmemory_share=2")
    with pytest.raises(ValueError, match="router must be one of"):
        parse_variant("x@nearest:a=1")
    with pytest.raises(ValueError, match=r"NAME\[@ROUTER\]:key=value"):
        parse_variant("no-colon")
    with pytest.raises(ValueError, match="taken"):
        build_configs("sticky", 24, 96, variants=[parse_variant("ideal:a=1")])
    shape = ConversationShape(conversations=4, rounds=6)
    # 2 conversations per engine at 2032 tokens (16 blocks each) need 32 + 4 blocks
    assert ideal_block_count(shape, 2, 128, 8) == 36
    assert ideal_block_count(shape, 2, 128, 24) == 96


def _run(config: str, repeat: int, ttfts: list[float], text: str = "a") -> ConfigRun:
    reqs = [RequestRecord(0, r, 0, t, t + 1, 100, 50, text) for r, t in enumerate(ttfts)]
    return ConfigRun(config, repeat, reqs, wall_s=2.0, counters={"vllm:prefix_cache_hits_total": 7})


def test_summary_takes_rounds_after_the_first_and_compares_configs_per_repeat() -> None:
    runs = []
    for rep, scale in ((0, 1.0), (1, 2.0)):
        runs += [
            _run("no-connector", rep, [9.0, 1.0 * scale, 1.0 * scale]),
            _run("umbp-redis", rep, [9.0, 0.6 * scale, 0.6 * scale], text="b"),
            _run("ideal", rep, [9.0, 0.5 * scale, 0.5 * scale]),
        ]
    s = summarize(["no-connector", "umbp-redis", "ideal"], runs)
    assert s["no-connector"]["ttft_mean_s"] == {"median": 1.5, "min": 1.0, "max": 2.0}
    assert s["umbp-redis"]["ideal_gain_share_mean"]["median"] == pytest.approx(0.8)
    assert s["umbp-redis"]["ttft_mean_vs_twin"]["median"] == pytest.approx(0.6)
    assert s["umbp-redis"]["outputs_equal_share"]["median"] == 0.0
    assert s["ideal"]["outputs_equal_share"]["median"] == 1.0
    assert s["umbp-redis"]["hit_tokens"]["median"] == 100  # rounds 2 and 3
    result = {
        "plan": {"engines": 2, "shape": {"conversations": 1, "rounds": 3}},
        "runs": [{"repeat": r.repeat} for r in runs],
        "summary": s,
    }
    table = format_table(result)
    assert "umbp-redis" in table and "80%" in table and "0.60x" in table


def test_engine_load_counts_requests_in_flight_on_the_same_engine() -> None:
    reqs = [
        RequestRecord(0, 1, 0, 0.1, 2.0, 10, 0, "", "", 0.0),  # in flight over [0, 2)
        RequestRecord(1, 1, 0, 0.1, 1.0, 10, 0, "", "", 1.5),  # sees the first
        RequestRecord(2, 1, 1, 0.1, 1.0, 10, 0, "", "", 1.6),  # another engine: alone
        RequestRecord(3, 1, 0, 0.1, 1.0, 10, 0, "", "", 2.0),  # the first ended: sees one
    ]
    assert ConfigRun("x", 0, reqs).engine_load() == pytest.approx((0 + 1 + 0 + 1) / 4)


def test_prometheus_text_is_summed_over_labels() -> None:
    text = (
        "# HELP vllm:prefix_cache_hits_total hits\n"
        'vllm:prefix_cache_hits_total{engine="0",model_name="m"} 128.0\n'
        'vllm:prefix_cache_hits_total{engine="1",model_name="m"} 256.0\n'
        'vllm:umbp_lookup_seconds_bucket{engine="0",le="+Inf"} 3.0\n'
        "vllm:umbp_lookup_seconds_sum 0.5\n"
    )
    got = parse_prometheus(text)
    assert got["vllm:prefix_cache_hits_total"] == 384.0
    assert got["vllm:umbp_lookup_seconds_sum"] == 0.5


def test_the_longest_request_is_the_last_round_and_its_answer() -> None:
    shape = ConversationShape(
        rounds=6, system_tokens=640, user_tokens=96, assistant_tokens=160, answer_tokens=16
    )
    assert shape.longest_request_tokens == 640 + 6 * 96 + 5 * 160 + 16


def test_repetition_shape_bounds_and_the_ideal_cache_size() -> None:
    shape = RepetitionShape(prompts=8, prefixes=2, prefix_tokens=300, suffix_tokens=64)
    shape.validate()
    assert shape.longest_request_tokens == 300 + 64 + 16 + RepetitionShape.RETOKENIZE_SLACK
    for bad in (
        RepetitionShape(prompts=1, prefixes=2),
        RepetitionShape(prefix_tokens=0),
        RepetitionShape(concurrency=0),
    ):
        with pytest.raises(ValueError):
            bad.validate()
    # Two prefixes of 3 blocks, then each of 8 prompts its own tail (1 block) and a
    # partial block, and the warm-ups: 2*3 + 8*2 + 4 = 26 blocks; at least 4x --blocks.
    assert repetition_ideal_block_count(shape, 128, 5) == 26
    assert repetition_ideal_block_count(shape, 128, 16) == 64


def test_vllms_client_accepts_the_pass_arguments_and_its_results_become_requests() -> None:
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    shape = RepetitionShape(prompts=6, prefixes=3, concurrency=2, seed=5)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(client_arguments(shape, "http://127.0.0.1:9", "m"))
    assert args.dataset_name == "prefix_repetition"
    assert (args.num_prompts, args.prefix_repetition_num_prefixes) == (6, 3)
    assert args.max_concurrency == 2 and args.seed == 5 and args.temperature == 0.0
    assert args.ready_check_timeout_sec == 0  # no probe request warms the measured engine
    assert args.save_detailed  # per-request results

    detailed = {
        "ttfts": [0.5, 0.0],
        "latencies": [0.9, 0.0],
        "start_times": [100.0, 100.25],
        "input_lens": [300, 301],
        "generated_texts": ["abc", ""],
        "errors": ["", "Bad Request"],
    }
    first, failed = requests_of(detailed)
    assert (first.index, first.ttft_s, first.latency_s, first.text) == (0, 0.5, 0.9, "abc")
    assert first.sent_at == 100.0 and first.prompt_tokens == 300
    assert failed.error == "Bad Request" and math.isnan(failed.ttft_s)
    with pytest.raises(RuntimeError):
        requests_of({"ttfts": []})


def test_the_client_workload_counts_hits_from_counters_and_says_what_it_measured() -> None:
    run = ConfigRun("umbp-redis", 0, hits_from_counters=True)
    run.requests = [RequestRecord(0, 1, 1, 0.2, 0.4, 300, 0, "x")]
    run.counters = {
        "vllm:prefix_cache_hits_total": 256.0,
        "vllm:external_prefix_cache_hits_total": 512.0,
    }
    assert run.hit_tokens() == 768
    title = workload_title(
        {
            "engines": 2,
            "shape": {"conversations": 4, "rounds": 6},
            "repetition": {
                "prompts": 8,
                "prefixes": 2,
                "prefix_tokens": 300,
                "suffix_tokens": 64,
                "concurrency": 4,
            },
        }
    )
    assert "prefix_repetition: 8 prompts" in title and "engine 1" in title
    assert "rounds 2-6" in workload_title(
        {"engines": 2, "shape": {"conversations": 4, "rounds": 6}}
    )
