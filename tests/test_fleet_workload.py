"""The fleet benchmark's logic: conversation scripts, routers, summaries (no engines)."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

from umbp_redis.bench.fleet import (
    ConfigRun,
    RequestRecord,
    Routing,
    build_configs,
    format_table,
    ideal_block_count,
    parse_variant,
    remote_hit_cost_ratio,
    repetition_ideal_block_count,
    request_id,
    summarize,
    workload_title,
)
from umbp_redis.bench.fleet_engines import EngineSpec, parse_prometheus
from umbp_redis.bench.fleet_vllm_client import client_arguments, requests_of
from umbp_redis.bench.fleet_workload import (
    ROUTINGS,
    ConversationScript,
    ConversationShape,
    LatencySummary,
    RepetitionShape,
    Router,
    percentile,
    routed_away_share,
    share_of_ideal_gain,
    vllm_router_policy,
)
from umbp_redis.bench.vllm_router import (
    RouterMissingError,
    RouterWorker,
    find_router_binary,
    kv_events_config,
    received_request_ids,
    router_command,
    served_by,
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
        "ideal-umbp",
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


def test_routings_name_this_packages_routers_or_a_vllm_router_policy() -> None:
    assert vllm_router_policy("round-robin") is None
    assert vllm_router_policy("vllm-router:kv_aware") == "kv_aware"
    assert {"vllm-router:round_robin", "vllm-router:cache_aware"} <= set(ROUTINGS)
    for bad in ("vllm-router", "vllm-router:power_of_two", "kv_aware", "nearest"):
        with pytest.raises(ValueError, match="routing must be one of"):
            vllm_router_policy(bad)


def test_the_routed_away_share_counts_turns_served_away_from_the_last_rounds_engine() -> None:
    served = [
        (0, 0, 0), (0, 1, 1), (0, 2, 1), (0, 3, 0),  # moved, stayed, moved
        (1, 0, 1), (1, 1, 1),  # stayed
        (2, 0, -1), (2, 1, 0),  # previous engine unknown: left out
        (3, 1, 0),  # no previous round: left out
    ]  # fmt: skip
    assert routed_away_share(served) == pytest.approx(2 / 4)
    assert math.isnan(routed_away_share([(0, 0, 0), (0, 1, -1)]))
    reqs = [
        RequestRecord(c, r, e, 0.1, 0.2, 10, 0, "", "", 0.0) for c, r, e in ((0, 0, 0), (0, 1, 1))
    ]
    reqs.append(RequestRecord(0, 2, 0, math.nan, math.nan, 0, 0, "", "boom", 0.0))
    assert ConfigRun("x", 0, reqs).routed_away_share() == 1.0  # a failed turn is left out
    # This package's routers: round-robin always moves a turn, sticky never does.
    for policy, share in (("round-robin", 1.0), ("sticky", 0.0)):
        router = Router(policy, 2)
        got = routed_away_share((c, r, router.engine_for(c, r)) for c in range(4) for r in range(6))
        assert got == share


def test_vllm_router_configs_variants_and_router_arguments() -> None:
    configs = build_configs(
        "vllm-router:kv_aware",
        24,
        96,
        router_args=["--kv-penalty-external", "0.9"],
        variants=[
            parse_variant("rr@round-robin:connector=false"),
            parse_variant("aff@vllm-router:kv_aware:router.router-temperature=5,load_async=true"),
        ],
    )
    by = {c.name: c for c in configs}
    assert by["no-connector"].vllm_router_policy == "kv_aware"
    assert by["umbp-redis"].router_args == ("--kv-penalty-external", "0.9")
    assert by["ideal"].router_args == () and by["ideal"].vllm_router_policy is None
    assert by["ideal-umbp"].connector and by["ideal-umbp"].num_blocks == 96
    assert not by["rr"].connector and by["rr"].router == "round-robin"
    assert by["rr"].router_args == ()  # this package's router takes none
    aff = by["aff"]
    assert aff.router == "vllm-router:kv_aware" and aff.connector_options == (("load_async", True),)
    assert aff.router_args == ("--kv-penalty-external", "0.9", "--router-temperature", "5")
    with pytest.raises(ValueError, match="router must be one of"):
        parse_variant("x@vllm-router:power_of_two:a=1")
    with pytest.raises(ValueError, match="need a vllm-router routing"):
        parse_variant("x@sticky:router.router-temperature=1")
    with pytest.raises(ValueError, match="no connector options"):
        parse_variant("x:connector=false,load_async=true")
    with pytest.raises(ValueError, match="routing must be one of"):
        build_configs("vllm-router:nearest", 24, 96)


def test_the_router_command_names_every_worker_and_its_event_sources(tmp_path: Path) -> None:
    workers = [
        RouterWorker("http://127.0.0.1:8001", "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5567"),
        RouterWorker("http://127.0.0.1:8002", "tcp://127.0.0.1:5558"),
    ]
    cmd = router_command(
        "/bin/vllm-router",
        workers,
        "kv_aware",
        128,
        "m",
        8000,
        29000,
        ["--router-temperature", "2"],
    )
    text = " ".join(cmd)
    assert "--policy kv_aware" in text and "--port 8000" in text
    assert "--worker-urls http://127.0.0.1:8001 http://127.0.0.1:8002" in text
    assert "--kv-event-block-size 128 --kv-event-model m" in text
    assert "--kv-event-source http://127.0.0.1:8001=tcp://127.0.0.1:5557" in text
    assert "--kv-event-source http://127.0.0.1:8002=tcp://127.0.0.1:5558" in text
    assert text.count("--kv-event-replay-source") == 1
    assert cmd[-2:] == ["--router-temperature", "2"]  # extra arguments last
    plain = router_command("r", [RouterWorker("http://a:1")], "kv_aware", 128, "m", 1, 2)
    assert "--kv-event-source" not in plain and "--kv-event-model" not in plain
    assert "--kv-event-source" not in router_command("r", workers, "round_robin", 128, "m", 1, 2)
    with pytest.raises(ValueError):
        router_command("r", [], "kv_aware", 128, "m", 1, 2)
    cfg = kv_events_config(5557, 5567)
    assert cfg["endpoint"] == "tcp://*:5557" and cfg["replay_endpoint"] == "tcp://*:5567"
    assert "topic" not in cfg  # the router drops frames of any other topic than ""
    spec = EngineSpec(
        "m", 16, "0", block_size=128, behind_router=True, kv_events_config=cfg, port=8001
    )
    engine = spec.command(spec.port)
    for flag in ("--enable-prefix-caching", "--enable-scale-out", "--enable-log-requests"):
        assert flag in engine
    assert engine[engine.index("--block-size") + 1] == "128"
    assert json.loads(engine[engine.index("--kv-events-config") + 1]) == cfg
    assert "--kv-events-config" not in EngineSpec("m", 16, "0").command(1)


def test_the_engine_that_served_a_request_is_read_from_the_engine_logs(tmp_path: Path) -> None:
    line = (
        "(APIServer pid=1) INFO 12-07 14:25:22 [request_logger.py:65] Received request "
        "cmpl-{}-0: params: SamplingParams(n=1, temperature=0.0)\n"
    )
    logs = [tmp_path / "engine0.log", tmp_path / "engine1.log"]
    logs[0].write_text(line.format("fleet-c0-r0") + line.format("fleet-c1-r1") + "noise\n")
    logs[1].write_text(
        line.format("fleet-c0-r1")
        + "(APIServer pid=2) INFO [async_llm.py:578] Added request cmpl-fleet-c0-r1-0-bdfed4ed.\n"
        + line.format("fleet-c1-r1")  # retried on a second engine: ambiguous
    )
    assert received_request_ids(logs[0].read_text()) == ["fleet-c0-r0", "fleet-c1-r1"]
    got = served_by(
        [*logs, tmp_path / "missing.log"], ["fleet-c0-r0", "fleet-c0-r1", "fleet-c1-r1", "x"]
    )
    assert got == {"fleet-c0-r0": 0, "fleet-c0-r1": 1, "fleet-c1-r1": -1, "x": -1}
    assert request_id(3, 5) == "fleet-c3-r5"


def test_routing_before_and_after_a_late_engine_joins() -> None:
    rr = Routing(Router("round-robin", 3), (), join_round=2, engines_before_join=2)
    assert [rr.target(0, r, [0, 0, 0]) for r in range(4)] == [0, 1, 2, 0]  # 3 from round 2
    assert {rr.target(c, 1, [0, 0, 0]) for c in range(6)} == {0, 1}  # before: 2 engines
    ll = Routing(Router("least-loaded", 3), (), join_round=1, engines_before_join=2)
    assert ll.target(0, 0, [5, 5, 0]) in (0, 1)  # the late engine is not up yet
    assert ll.target(0, 1, [5, 5, 0]) == 2
    assert Routing(None, ("http://router",)).target(0, 0, []) == -1  # the router picks


def test_the_remote_hit_cost_ratio_charges_prefill_beyond_computed_tokens_to_loaded_ones() -> None:
    def run(prefill: float, queried: float, local: float, loaded: float) -> ConfigRun:
        counters = {
            "vllm:request_prefill_time_seconds_sum": prefill,
            "vllm:prefix_cache_queries_total": queried,
            "vllm:prefix_cache_hits_total": local,
            "vllm:external_prefix_cache_hits_total": loaded,
        }
        return ConfigRun("x", 0, counters=counters)

    twin = run(10.0, 2000.0, 1000.0, 0.0)  # 1000 computed tokens: 10 ms each
    # 500 computed (5 s at the twin's rate), 500 loaded for the other 1 s: 0.2 ms each.
    assert remote_hit_cost_ratio(run(6.0, 2000.0, 1000.0, 500.0), twin) == pytest.approx(0.2)
    assert math.isnan(remote_hit_cost_ratio(twin, twin))  # nothing loaded
    assert math.isnan(remote_hit_cost_ratio(run(6.0, 10.0, 10.0, 5.0), run(1.0, 5.0, 5.0, 0.0)))


def test_find_router_binary_names_the_extra_where_it_is_missing(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    with pytest.raises(RouterMissingError, match=r"umbp-redis\[router\]"):
        find_router_binary()
    beside = tmp_path / "vllm-router"
    beside.write_text("#!/bin/sh\n")
    beside.chmod(0o755)
    assert find_router_binary() == str(beside)
