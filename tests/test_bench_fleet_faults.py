"""``umbp-redis bench fleet --faults``: the schedule's parser, the injector against a
private Redis with stand-in engines, and the bench end to end with two real engines on
the tiny model, Redis killed, paused and squeezed under the umbp-redis configuration."""

from __future__ import annotations

import os
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from helpers import run_bench_fleet

from umbp_redis.bench.fleet_faults import (
    LOADED,
    Fault,
    FaultInjector,
    parse_faults,
)
from umbp_redis.testing.embedded_redis import EmbeddedRedis


def test_parse_faults_reads_the_schedule_in_order() -> None:
    assert parse_faults("kill@20+8, kill-keep@50+5,pause@80+4,sleep@100+0.5,maxmemory@120+15") == (
        Fault("kill", 20, 8),
        Fault("kill-keep", 50, 5),
        Fault("pause", 80, 4),
        Fault("sleep", 100, 0.5),
        Fault("maxmemory", 120, 15),
    )
    assert Fault("sleep", 100, 0.5).label == "sleep@100+0.5"


@pytest.mark.parametrize(
    "text",
    ["", "kill", "kill@3", "kill+3", "nap@1+2", "kill@x+2", "kill@-1+2", "kill@1+0",
     "kill@5+2,pause@1+1", "kill@1+4,pause@3+1"],
)  # fmt: skip
def test_parse_faults_names_the_option_and_the_form(text: str) -> None:
    with pytest.raises(ValueError, match="--faults"):
        parse_faults(text)


class _StandInEngine:
    """An engine's counters: every scrape sees one more block loaded."""

    def __init__(self) -> None:
        self.proc = SimpleNamespace(pid=os.getpgrp())
        self.loaded = 0.0

    def metrics(self) -> dict[str, float]:
        self.loaded += 1
        return {LOADED: self.loaded}


def test_the_injector_applies_each_fault_and_lifts_it() -> None:
    faults = parse_faults("kill-keep@0+0.3,maxmemory@0.5+0.3,kill@1+0.3,pause@1.5+0.3,sleep@2+0.3")
    with EmbeddedRedis() as server:
        with redis.Redis.from_url(server.url) as r:
            r.mset({f"k{i}": os.urandom(10_000) for i in range(200)})
        engine = _StandInEngine()
        injector = FaultInjector(server, lambda: [engine], faults)  # type: ignore[arg-type, list-item]
        injector.start(time.perf_counter())
        assert injector.wait_for_schedule(timeout_s=120)
        injector.stop()
        report = injector.report([])
        with redis.Redis.from_url(server.url) as r:
            # The limit and policy are back, and the server answers.
            assert r.config_get("maxmemory")["maxmemory"] == "0"
            assert r.config_get("maxmemory-policy")["maxmemory-policy"] == "noeviction"
    kill_keep, squeeze, kill, pause, sleep = report
    for f in report:
        assert not f["error"], f
        assert f["started_s"] < f["ended_s"]
        assert set(f["phases"]) == {"before", "during", "after"}
    # SAVE, SIGKILL, restart: every key comes back from the dump.
    assert kill_keep["keys_before"] == kill_keep["keys_after"] == 200
    assert kill_keep["save_s"] is not None
    # A tenth of used_memory cannot hold them: Redis evicts.
    assert squeeze["evicted_keys"] > 0 and squeeze["keys_after"] < squeeze["keys_before"] == 200
    # SIGKILL and restart with the dump removed: nothing is loaded.
    assert kill["keys_before"] == squeeze["keys_after"]
    assert kill["keys_after"] == 0
    assert pause["keys_before"] == sleep["keys_before"] == 0
    # The stand-in loads at every scrape, and stop() scrapes once more.
    assert sleep["hits_back_s"] is not None
    assert set(injector.rss_bytes) == {"start", "end"}
    assert injector.rss_bytes["start"][0] > 0


# Four conversations of 12 rounds (about 20 s on the tiny model); a user reads each
# answer for 1.5 s. Round r of conversation c runs on engine (c + r) mod 2 and loads the
# history the other engine stored in round r - 1.
CONVERSATIONS = (
    "--conversations", "4", "--rounds", "12", "--system-tokens", "300",
    "--user-tokens", "48", "--assistant-tokens", "64", "--think-time-s", "1.5",
)  # fmt: skip
# Pause and squeeze first; the kill last, so that its hits back are looked for over
# every round the conversations still have after it.
SCHEDULE = "pause@2+2,maxmemory@5+2,kill@8+2"


@pytest.mark.vllm
def test_the_fleet_bench_injects_redis_faults_and_reports_them_by_phase(
    tiny_model: Path, tmp_path: Path
) -> None:
    result: dict[str, Any] = run_bench_fleet(
        tiny_model, tmp_path, "--faults", SCHEDULE, *CONVERSATIONS, timeout_s=900
    )
    runs = {r["config"]: r for r in result["runs"]}
    for name, run in runs.items():
        print(f"{name}: the workload ran {run['wall_s']:.1f} s")
    faults = result["faults"]
    assert [f["label"] for f in faults["schedule"]] == SCHEDULE.split(",")
    # Requests go on through every fault; the answers are the connector-less engines'.
    assert faults["failed_requests"]["umbp-redis"] == 0
    assert len(runs["umbp-redis"]["requests"]) == 4 * 12
    assert faults["outputs_equal_share"]["umbp-redis"] == 1.0
    by_config = {r["config"]: r["faults"] for r in faults["runs"]}
    assert set(by_config) == {"no-connector", "umbp-redis"}
    for reports in by_config.values():
        assert [f["label"] for f in reports] == SCHEDULE.split(",")
        for f in reports:
            assert not f["error"], f
            assert f["started_s"] < f["ended_s"]
            for phase in ("before", "during", "after"):
                stats = f["phases"][phase]
                assert stats["completed"] + stats["failed"] == stats["sent"]
        kill = reports[2]
        assert kill["keys_after"] == 0  # the restart is empty
    kill = by_config["umbp-redis"][2]
    # Without the connector nothing is ever loaded; with it, loads resume after the
    # empty restart once the engines have stored the conversations' next rounds.
    assert all(f["hits_back_s"] is None for f in by_config["no-connector"])
    assert kill["hits_back_s"] is not None
    assert runs["umbp-redis"]["engine_rss_bytes"]["end"][0] > 0
