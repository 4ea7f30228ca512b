"""UMBPRedisConnector in real vLLM engines (CPU, the tiny model) against real Redis.

Each engine runs in its own process (``engine_runner.py``); engines are started few
times and run several phases each.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
from helpers import BLOCK, PROMPTS, cli, connector, full_blocks, run_engine, tokens
from typed_redis import raw

from umbp_redis.data import BlockIdentityCodec, namespace_pattern, parse_key, value_pattern
from umbp_redis.testing.embedded_cluster import EmbeddedCluster
from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="module")
def baseline(work: Path, tiny_model: Path) -> dict:  # type: ignore[type-arg]
    """Greedy outputs of the same engine without the connector."""
    return run_engine(work, "baseline", tiny_model, None, [{"op": "generate", "name": "g"}])["g"]


@dataclass(frozen=True)
class ColdRun:
    """A cold engine's results and every key it left in Redis (``DUMP``, with TTLs)."""

    result: dict[str, Any]
    snapshot: list[tuple[bytes, int, bytes]]


@pytest.fixture(scope="module")
def cold(work: Path, tiny_model: Path) -> ColdRun:
    """One cold engine on the defaults, on a server of its own, and what it stored."""
    with EmbeddedRedis() as srv:
        res = run_engine(
            work, "cold", tiny_model, connector(srv.url), [{"op": "generate", "name": "g"}]
        )
        r = redis.Redis.from_url(srv.url)
        snapshot = [(k, int(r.pttl(k)), raw(r.dump(k))) for k in r.scan_iter(count=1000)]
        r.close()
    return ColdRun(res["g"], snapshot)


@pytest.fixture
def server(cold: ColdRun) -> Any:
    """A server of this test alone holding what the cold engine stored."""
    with EmbeddedRedis() as s:
        r = redis.Redis.from_url(s.url)
        for key, pttl, dump in cold.snapshot:
            r.restore(key, max(pttl, 0), dump)
        r.close()
        yield s


def test_cold_engine_stores_every_complete_prompt_block(
    cold: ColdRun, baseline: dict, server: EmbeddedRedis
) -> None:  # type: ignore[type-arg]
    assert tokens(cold.result) == tokens(baseline)
    r = redis.Redis.from_url(server.url)
    keys = [k.decode() for k in r.scan_iter(match=value_pattern())]
    # Prompts share their first 2 blocks, then each has one block of its own.
    n_blocks = {full_blocks(o["prompt_tokens"]) for o in cold.result["outputs"]}
    assert n_blocks == {3}
    assert len(keys) == 2 + len(PROMPTS)
    namespaces = set()
    for k in keys:
        d = parse_key(k)
        namespaces.add(d.namespace)
        assert (d.tp_rank, d.pp_rank, d.group_id) == (0, 0, 0) and len(d.block_hash) == 32
        assert 0 < r.ttl(k) <= 86400
        assert r.hstrlen(k, "b") > 0
    assert len(namespaces) == 1
    # Every stored block got its stored marker (the one key lookups read), with the TTL.
    (ns,) = namespaces
    codec = BlockIdentityCodec(ns)
    markers = {k for k in r.scan_iter(match=codec.marker_prefix(0) + "*")}
    assert markers == {codec.marker_key(parse_key(k).block_hash, 0) for k in keys}
    assert all(0 < r.ttl(m) <= 86400 for m in markers)
    # The operator CLI reads what a real engine stored.
    ls = json.loads(cli("ls", "--redis-url", server.url, "--json").stdout)
    assert ls["namespaces"] == {namespaces.pop(): len(keys)}
    assert {k["value_bytes"] for k in ls["keys"]} == {2 * 65536}  # 2 layers x 64 KiB pages
    info = cli("inspect", keys[0], "--redis-url", server.url, "--json")
    assert info.returncode == 0 and json.loads(info.stdout)["valid"] is True


def test_engines_with_other_model_settings_never_share_objects(
    work: Path, tiny_model: Path, server: EmbeddedRedis
) -> None:
    r = redis.Redis.from_url(server.url)
    before = {parse_key(k).namespace for k in r.scan_iter(match=value_pattern())}
    res = run_engine(
        work,
        "override",
        tiny_model,
        connector(server.url),
        [{"op": "generate", "name": "g"}],
        engine_args={"hf_overrides": {"rope_theta": 5000.0}},
    )
    # Nothing loaded from the first engines' objects: only local prefix-cache hits.
    first = res["g"]["outputs"][0]
    assert first["cached"] == 0
    after = {parse_key(k).namespace for k in r.scan_iter(match=value_pattern())}
    assert len(before) == 1 and before < after and len(after) == 2
    # The operator CLI over what the two engines stored.
    new_ns, old_ns = (after - before).pop(), next(iter(before))
    stats = json.loads(cli("stats", "--redis-url", server.url, "--json").stdout)
    assert set(stats["namespaces"]) == after
    assert stats["namespaces"][new_ns]["keys"] == stats["namespaces"][old_ns]["keys"]
    doctor = cli("doctor", "--redis-url", server.url)
    assert doctor.returncode == 0 and "reachable" in doctor.stdout
    purge = cli("purge", "--namespace", new_ns, "--yes", "--redis-url", server.url, "--json")
    # Its values and their stored markers, one each a block at TP=1, and its record.
    assert json.loads(purge.stdout)["deleted"] == 2 * stats["namespaces"][new_ns]["keys"] + 1
    left = {parse_key(k).namespace for k in r.scan_iter(match=value_pattern())}
    assert left == before  # the other engine's objects are intact
    assert not list(r.scan_iter(match=namespace_pattern(new_ns)))
    # A copy of an engine's object with a damaged header fails validation.
    src = next(iter(r.scan_iter(match=value_pattern(old_ns)))).decode()
    bad = BlockIdentityCodec(old_ns).key(b"\xab" * 32, 0)
    r.restore(bad, 0, raw(r.dump(src)))
    h = raw(r.hget(bad, "h") or b"")
    r.hset(bad, "h", h[:4] + b"\x09\x00" + h[6:])  # format version 9
    inspect = cli("inspect", bad, "--redis-url", server.url, "--json")
    assert inspect.returncode == 1 and "version" in json.loads(inspect.stdout)["error"]
    r.delete(bad)


def test_fresh_engine_loads_prefix_and_survives_bad_values_and_outages(
    work: Path, tiny_model: Path, baseline: dict, server: EmbeddedRedis
) -> None:  # type: ignore[type-arg]
    url = server.url
    phases = [
        {"op": "generate", "name": "warm"},
        {"op": "corrupt", "url": url, "name": "corrupted"},
        {"op": "reset"},
        {"op": "generate", "name": "after_corrupt"},
        {"op": "count_keys", "url": url, "name": "keys_after_corrupt"},
        {"op": "delete", "url": url, "name": "deleted"},
        {"op": "reset"},
        {"op": "generate", "name": "after_delete"},
        {"op": "shutdown_redis", "url": url},
        {"op": "reset"},
        {"op": "generate", "name": "redis_down"},
        {"op": "start_redis", "port": server.port},
        {"op": "reset"},
        {"op": "generate", "name": "redis_back"},
        {"op": "count_keys", "url": url, "name": "keys_back"},
    ]
    res = run_engine(
        work,
        "warm",
        tiny_model,
        connector(url),
        phases,
        env={"VLLM_LOG_STATS_INTERVAL": "0.5"},
        engine_args={"disable_log_stats": False},
    )
    log = (work / "warm.log").read_text()
    # The connector's counters appear in vLLM's periodic log.
    assert "KV Transfer metrics: blocks_loaded=" in log
    expected = tokens(baseline)
    for phase in ("warm", "after_corrupt", "after_delete", "redis_down", "redis_back"):
        assert tokens(res[phase]) == expected, phase
    # The warm engine hit every complete block but the last token's in Redis.
    for o in res["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    assert res["corrupted"] == 2 + len(PROMPTS)
    # Damaged objects were recomputed and replaced with good ones.
    assert res["keys_after_corrupt"] == 2 + len(PROMPTS)
    # With Redis down only the local prefix cache (just reset) could hit.
    assert all(o["cached"] <= 2 * BLOCK for o in res["redis_down"]["outputs"])
    assert res["keys_back"] == 2 + len(PROMPTS)  # stores resumed once Redis was back


def test_transfer_threads_leave_the_cpus_of_vllms_openmp_threads(
    work: Path, tiny_model: Path, baseline: dict, redis_url: str
) -> None:  # type: ignore[type-arg]
    """transfer_cpus auto, in an engine core of its own process as vLLM runs it by
    default, with one CPU reserved (vLLM reserves two with a connector, all of this
    machine's): the worker's OpenMP threads are bound, the transfer threads leave them."""
    res = run_engine(
        work,
        "threads",
        tiny_model,
        connector(redis_url),
        [{"op": "generate", "name": "g"}],
        env={"VLLM_CPU_NUM_OF_RESERVED_CPU": "1"},
        engine_core_process=True,
    )
    assert tokens(res["g"]) == tokens(baseline)
    log = (work / "threads.log").read_text()
    bound = re.search(r"local_rank=0, core ids=\[([0-9, ]+)\]", log)
    moved = re.search(r"transfer threads run on CPUs \[([0-9, ]+)\]", log)
    assert bound is not None and moved is not None, log[-3000:]
    omp = {int(c) for c in bound.group(1).split(",")}
    transfer = {int(c) for c in moved.group(1).split(",")}
    assert omp < transfer


def test_cold_then_warm_on_a_cluster_with_a_master_killed_mid_run(
    work: Path,
    tiny_model: Path,
    baseline: dict,  # type: ignore[type-arg]
) -> None:
    with EmbeddedCluster(node_timeout_ms=1000) as cl:
        ports = [n.port for n in cl.masters]
        victim = cl.masters[0]
        assert victim.proc is not None
        phases = [
            {"op": "generate", "name": "cold"},
            {"op": "node_keys", "ports": ports, "name": "keys"},
            {"op": "reset"},
            {"op": "generate", "name": "warm"},
            {"op": "kill_pid", "pid": victim.proc.pid},
            {"op": "reset"},
            {"op": "generate", "name": "master_down"},
            {
                "op": "cluster_failover",
                "ports": [n.port for n in cl.nodes],
                "victim": victim.port,
                "masters": len(ports),
            },
            {"op": "reset"},
            {"op": "generate", "name": "after_failover"},
            {"op": "reset"},
            {"op": "generate", "name": "after_repair"},
        ]
        res = run_engine(work, "cluster", tiny_model, connector(cl.url), phases)
        masters_after = cl.current_masters()
    expected = tokens(baseline)
    for phase in ("cold", "warm", "master_down", "after_failover", "after_repair"):
        assert tokens(res[phase]) == expected, phase
    assert sum(res["keys"]) == 2 + len(PROMPTS)  # every block once, on its slot's master
    assert sum(1 for n in res["keys"] if n) >= 2
    for o in res["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    # After the failover the promoted replica serves the victim's slots (with what was
    # replicated), the other masters theirs: hits again. A block whose stored marker
    # lives on a live master while a value was on the dead one failed its load while
    # the master was down and is quarantined on this engine until it is stored again
    # (recomputed once), so the hits come back over the next passes.
    assert len(masters_after) == 3 and victim not in masters_after
    hits = [sum(o["cached"] for o in res[p]["outputs"]) for p in ("after_failover", "after_repair")]
    assert 0 < hits[0] <= hits[1]
    log = (work / "cluster.log").read_text()
    assert "Traceback" not in log


@pytest.mark.parametrize(
    ("quarantine_s", "load_async"), [(300, True), (0, "auto")], ids=["quarantine", "no-quarantine"]
)
def test_a_block_that_fails_to_load_is_not_offered_again(
    work: Path,
    tiny_model: Path,
    baseline: dict,  # type: ignore[type-arg]
    quarantine_s: int,
    load_async: bool | str,
) -> None:
    """A value whose load fails (WRONGTYPE: it stays) is quarantined; without the
    quarantine each new request fails on it again, but never loops on it: vLLM asks
    again after a failed load at the prompt's start, and the request gets no hits.
    Loads are async in the first case; in the second the default (auto) loads the tiny
    model's small hits before the step (sync), so a failed sync load is recomputed too."""
    with EmbeddedRedis() as srv:
        url = srv.url
        phases = [
            {"op": "generate", "name": "cold"},
            {"op": "wrongtype", "url": url, "name": "bad_key"},
            {"op": "reset"},
            {"op": "generate", "name": "first"},
            {"op": "plane_counters", "name": "after_first"},
            {"op": "reset"},
            {"op": "generate", "name": "second"},
            {"op": "plane_counters", "name": "after_second"},
            {"op": "load_totals", "name": "loads"},
        ]
        res = run_engine(
            work,
            f"quarantine{quarantine_s}",
            tiny_model,
            connector(url, load_failure_quarantine_s=quarantine_s, load_async=load_async),
            phases,
        )
    for phase in ("cold", "first", "second"):
        assert tokens(res[phase]) == tokens(baseline), phase
    failed_first = res["after_first"]["load_errors"]
    assert failed_first >= 1  # the WRONGTYPE value failed its load and was recomputed
    if quarantine_s:
        # The next requests do not try it again (and still hit what precedes it).
        assert res["after_second"]["load_errors"] == failed_first
    else:
        assert res["after_second"]["load_errors"] > failed_first
    assert res["after_second"]["loaded_objects"] > res["after_first"]["loaded_objects"]
    loads = res["loads"]
    assert loads["loads"] >= 2 and loads["load_failures"] >= 1
    assert loads["sync_loads"] == (0 if load_async is True else loads["loads"])


def test_kv_cache_events_announce_what_redis_holds(
    work: Path,
    tiny_model: Path,
    baseline: dict,  # type: ignore[type-arg]
) -> None:
    with EmbeddedRedis() as srv:
        phases = [
            {"op": "generate", "name": "cold"},
            {"op": "kv_events", "name": "events"},
        ]
        res = run_engine(
            work, "events", tiny_model, connector(srv.url), phases, kv_events_port=free_port()
        )
        stored_keys = len(list(redis.Redis.from_url(srv.url).scan_iter(match=value_pattern())))
    assert tokens(res["cold"]) == tokens(baseline)
    redis_events = [e for e in res["events"] if e["medium"] == "REDIS"]
    assert redis_events and {e["type"] for e in redis_events} == {"BlockStored"}
    announced = [h for e in redis_events for h in e["hashes"]]
    # Every stored block announced exactly once (TP=1: one object a block).
    assert len(announced) == len(set(announced)) == stored_keys == 2 + len(PROMPTS)
    # vLLM's own (GPU-medium) events still flow alongside.
    assert any(e["medium"] != "REDIS" and e["type"] == "BlockStored" for e in res["events"])


def test_unreachable_redis_at_startup(work: Path, tiny_model: Path, baseline: dict) -> None:  # type: ignore[type-arg]
    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    phases = [
        {"op": "generate", "name": "dead"},
        {"op": "start_redis", "port": port},
        {"op": "reset"},
        {"op": "generate", "name": "alive"},
        {"op": "count_keys", "url": url, "name": "keys"},
    ]
    # Loaded by name alone, through the vllm.general_plugins entry point.
    res = run_engine(work, "dead", tiny_model, connector(url, module_path=False), phases)
    assert tokens(res["dead"]) == tokens(baseline)
    assert tokens(res["alive"]) == tokens(baseline)
    assert res["keys"] == 2 + len(PROMPTS)


def test_a_password_in_the_config_stops_the_engine_at_startup(work: Path, tiny_model: Path) -> None:
    """vLLM prints kv_connector_extra_config at startup: a password there is refused, with
    an error naming the ways that keep it out of logs and never repeating it."""
    url = f"redis://umbp:hunter2-in-url@127.0.0.1:{free_port()}/0"
    with pytest.raises(AssertionError, match="engine secret failed") as ei:
        run_engine(work, "secret", tiny_model, connector(url), [{"op": "generate", "name": "g"}])
    output = str(ei.value)
    refusals = [line for line in output.splitlines() if "is refused" in line]
    assert refusals, output[-3000:]
    for line in refusals:
        assert "password_file" in line and "UMBP_REDIS_PASSWORD" in line
        assert "redis_url" in line and "hunter2" not in line


def test_tensor_parallel_two_ranks(work: Path, tiny_model: Path, baseline: dict) -> None:  # type: ignore[type-arg]
    """Two TP ranks, sync loads (their stores of a load's step wait for its outcome):
    warm tokens equal cold ones; prompts extended past what Redis holds, answered with
    one token (they end in the step of their sync load), still store their new blocks,
    so the same prompts hit them all next; a rank's values deleted under their markers
    fail the loads into recomputes, and the blocks are stored again; an LRU Redis too
    small for the blocks evicts values and markers apart, and tokens stay equal."""
    extra = sample_prompts(len(PROMPTS), 200, seed=9)
    longer = [p + " " + e for p, e in zip(PROMPTS, extra, strict=True)]
    churn = sample_prompts(4, 400, seed=21)
    with EmbeddedRedis() as srv:
        url = srv.url
        phases = [
            {"op": "generate", "name": "cold"},
            {"op": "reset"},
            {"op": "generate", "name": "warm"},
            {"op": "reset"},
            {"op": "generate", "name": "longer", "prompts": longer, "max_tokens": 1},
            {"op": "reset"},
            {"op": "generate", "name": "longer_warm", "prompts": longer, "max_tokens": 1},
            {
                "op": "delete_pattern",
                "url": url,
                "pattern": value_pattern(tp_rank=1),
                "name": "tp1",
            },
            {"op": "reset"},
            {"op": "generate", "name": "one_rank_missing"},
            {"op": "reset"},
            {"op": "generate", "name": "repaired"},
            {
                "op": "count_keys",
                "url": url,
                "pattern": value_pattern(tp_rank=1),
                "name": "tp1_end",
            },
            # An LRU Redis with room for about 10 rank values (5 blocks at TP=2): the
            # prompts' 6 blocks, then others', evict values and markers in any mix.
            {"op": "limit_memory", "url": url, "objects": 10, "object_bytes": 65536},
            {"op": "reset"},
            {"op": "generate", "name": "lru_first"},
            {"op": "reset"},
            {"op": "generate", "name": "lru_churn", "prompts": churn},
            {"op": "evicted", "url": url, "name": "evicted"},
            {"op": "reset"},
            {"op": "generate", "name": "lru_warm"},
        ]
        res = run_engine(work, "tp2", tiny_model, connector(url, load_async=False), phases, tp=2)
    for phase in ("cold", "warm", "one_rank_missing", "repaired", "lru_first", "lru_warm"):
        assert tokens(res[phase]) == tokens(baseline), phase
    assert res["evicted"] > 0
    for o in res["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    for o, short in zip(res["longer"]["outputs"], res["warm"]["outputs"], strict=True):
        assert full_blocks(o["prompt_tokens"]) > full_blocks(short["prompt_tokens"])
        assert o["cached"] == full_blocks(short["prompt_tokens"]) * BLOCK
    for o in res["longer_warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    assert tokens(res["longer_warm"]) == tokens(res["longer"])
    # Every block has a key per TP rank: the 2 shared blocks, then each prompt's own.
    blocks = sum(full_blocks(o["prompt_tokens"]) - 2 for o in res["longer"]["outputs"])
    assert res["tp1"] == 2 + blocks
    # The blocks' stored markers stayed, so the lookup offered them although tp1's
    # values were gone: tp1's loads failed and vLLM recomputed them (equal tokens
    # above), and the engine stored them again, every rank's value (a pass returns
    # with its last stores possibly in flight: counted after the next one).
    assert res["one_rank_missing"]["outputs"][0]["cached"] == 3 * BLOCK
    short = sum(full_blocks(o["prompt_tokens"]) - 2 for o in res["warm"]["outputs"])
    assert res["tp1_end"] == 2 + short


def test_preemption_under_a_small_kv_cache(work: Path, tiny_model: Path) -> None:
    prompts = sample_prompts(6, 375, seed=4)
    with EmbeddedRedis() as srv:
        phases = [{"op": "generate", "name": "g", "prompts": prompts}]
        plain = run_engine(
            work,
            "small_plain",
            tiny_model,
            None,
            phases,
            max_tokens=40,
            max_model_len=1024,
            engine_args={"num_gpu_blocks_override": 10},
        )
        phases = [
            {"op": "generate", "name": "cold", "prompts": prompts},
            {"op": "reset"},
            {"op": "generate", "name": "warm", "prompts": prompts},
            {"op": "leak_check", "name": "leak"},
        ]
        res = run_engine(
            work,
            "small",
            tiny_model,
            connector(srv.url),
            phases,
            max_tokens=40,
            max_model_len=1024,
            engine_args={"num_gpu_blocks_override": 10},
        )
        log = (work / "small.log").read_text()
    assert tokens(res["cold"]) == tokens(plain["g"])
    assert tokens(res["warm"]) == tokens(plain["g"])
    assert sum(o["cached"] for o in res["warm"]["outputs"]) > sum(
        o["cached"] for o in res["cold"]["outputs"]
    )
    assert "Traceback" not in log
    assert "requests preempted" in log  # the small cache did force preemptions
    # Nothing stays pinned, no staging slot stays taken, no request state lingers.
    assert res["leak"] == {
        "pinned_blocks": 0,
        "staging_in_use": 0,
        "tracked_requests": 0,
        "lazy_pending": 0,
    }


def run_lazy_small(
    work: Path, name: str, model: Path, url: str, other: list[str], blocks: int
) -> dict[str, Any]:
    """An engine in lazy store mode with a KV cache of ``blocks`` blocks: PROMPTS
    (``cold``), then ``other`` prompts that evict their blocks, then PROMPTS again
    (``warm``), with key counts after the first two and a leak check at the end."""
    return run_engine(
        work,
        name,
        model,
        connector(url, store_mode="lazy"),
        [
            {"op": "generate", "name": "cold"},
            {"op": "count_keys", "name": "after_cold", "url": url},
            {"op": "generate", "name": "other", "prompts": other},
            {"op": "count_keys", "name": "after_other", "url": url},
            {"op": "generate", "name": "warm"},
            {"op": "leak_check", "name": "leak"},
        ],
        max_model_len=1024,
        engine_args={"num_gpu_blocks_override": blocks},
    )


def test_lazy_store_mode_stores_what_vllm_evicts_and_nothing_else(
    work: Path,
    tiny_model: Path,
    baseline: dict,  # type: ignore[type-arg]
) -> None:
    other = sample_prompts(4, 420, seed=7)
    fresh = sample_prompts(3, 420, seed=9)
    with EmbeddedRedis() as srv:
        # A small KV cache (11 usable blocks, a prompt needs 4): the second prompt set
        # evicts the first one's blocks, which are stored on their way out.
        small = run_lazy_small(work, "lazy_small", tiny_model, srv.url, other, blocks=12)
        # A fresh engine with a large KV cache: every prompt block comes from Redis, and
        # new prompts, which its cache never evicts, cost no Redis writes at all.
        big = run_engine(
            work,
            "lazy_big",
            tiny_model,
            connector(srv.url, store_mode="lazy"),
            [
                {"op": "count_keys", "name": "before", "url": srv.url},
                {"op": "generate", "name": "warm"},
                {"op": "generate", "name": "fresh", "prompts": fresh},
                {"op": "count_keys", "name": "after", "url": srv.url},
            ],
        )
        log = (work / "lazy_small.log").read_text() + (work / "lazy_big.log").read_text()
    assert "Traceback" not in log
    for phase in ("cold", "warm"):
        assert tokens(small[phase]) == tokens(baseline)
    assert tokens(big["warm"]) == tokens(baseline)
    # PROMPTS share 2 blocks and have one of their own each: all 6 reached Redis only
    # because the small cache evicted them.
    assert small["after_other"] >= 2 + len(PROMPTS)
    assert small["after_cold"] <= small["after_other"]
    for o in big["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    # Eager mode would have stored every full prompt block of the fresh prompts.
    fresh_blocks = sum(full_blocks(o["prompt_tokens"]) for o in big["fresh"]["outputs"])
    assert fresh_blocks >= 9 and big["after"] == big["before"]
    # Every pin was released by its store's report, except the blocks of the last
    # finished requests, pinned for the step that never came (the engine went idle).
    leak = small["leak"]
    assert leak["staging_in_use"] == 0 and leak["tracked_requests"] == 0
    assert leak["pinned_blocks"] == leak["lazy_pending"] <= 3 * len(PROMPTS)


def test_hybrid_sliding_window_model_stores_per_group_and_loads_every_hit(
    work: Path, hybrid_model: Path
) -> None:
    """A model with a sliding-window layer and a full-attention layer, with vLLM's hybrid
    KV cache manager on: full attention stores every block, the window only the 2 blocks
    (256 tokens) before hit points; fresh engines hit every prompt block and the shared
    prefix alone, with the tokens of an engine without the connector."""
    long_prompt = sample_prompts(1, 900, seed=5)[0]
    shares_prefix = sample_prompts(5, 420, seed=1, shared_prefix_words=300)[4]
    prompts = [*PROMPTS, long_prompt]
    every = [*prompts, shares_prefix]
    with EmbeddedRedis() as srv:
        plain = run_engine(
            work,
            "hyb_plain",
            hybrid_model,
            None,
            [{"op": "generate", "name": "g", "prompts": every}],
        )
        cold = run_engine(
            work,
            "hyb_cold",
            hybrid_model,
            connector(srv.url),
            [{"op": "generate", "name": "g", "prompts": prompts}],
        )
        r = redis.Redis.from_url(srv.url)
        by_group: dict[int, int] = {}
        for k in r.scan_iter(match=value_pattern()):
            g = parse_key(k.decode()).group_id
            by_group[g] = by_group.get(g, 0) + 1
        warm = run_engine(
            work,
            "hyb_warm",
            hybrid_model,
            connector(srv.url),
            [
                {"op": "generate", "name": "prefix", "prompts": [shares_prefix]},
                {"op": "generate", "name": "g", "prompts": prompts},
                {"op": "corrupt", "url": srv.url, "name": "corrupted"},
                {"op": "reset"},
                {"op": "generate", "name": "after_corrupt", "prompts": prompts},
                {"op": "validate", "url": srv.url, "name": "after_corrupt_values"},
            ],
        )
        log = (work / "hyb_cold.log").read_text()
    assert "Turning off hybrid kv cache manager" not in log
    assert "group 1 object" in log  # the worker planned two cache groups
    want = tokens(plain["g"])
    assert tokens(cold["g"]) == want[: len(prompts)]
    assert tokens(warm["g"]) == want[: len(prompts)]
    assert tokens(warm["prefix"]) == want[-1:]
    # Every prompt block of every prompt from Redis in a fresh engine; a prompt that
    # shares only the 2-block prefix hits it (its window was stored where the first
    # prompts left the shared prefix).
    for o in warm["g"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    assert warm["prefix"]["outputs"][0]["cached"] == 2 * BLOCK
    # Every value damaged: vLLM cannot take block-level load failures of a model with
    # several cache groups (it stops the engine), so the loads fail per request; the
    # engine recomputes the prompts and the damaged values it read are replaced by good
    # ones (every full-attention block; window blocks no prompt needed stay damaged
    # until a load reads them).
    assert tokens(warm["after_corrupt"]) == want[: len(prompts)]
    after = warm["after_corrupt_values"]
    assert after["keys"] == warm["corrupted"]
    assert after["valid"] >= by_group[1]
    warm_log = (work / "hyb_warm.log").read_text()
    assert "invalid objects removed" in warm_log and "EngineDeadError" not in warm_log
    # Group 0 is the sliding window, group 1 full attention.
    n_long = cold["g"]["outputs"][-1]["prompt_tokens"]
    long_blocks = n_long // BLOCK
    assert long_blocks >= 6
    assert by_group[1] == 2 + len(PROMPTS) + long_blocks
    window = {b for end in {(n_long - 1) // BLOCK, n_long // BLOCK} for b in (end - 2, end - 1)}
    assert by_group[0] == 2 + len(PROMPTS) + len(window)


def test_hybrid_model_in_lazy_store_mode_stores_on_eviction_and_loads_right_tokens(
    work: Path, hybrid_model: Path
) -> None:
    """Lazy stores with two KV cache groups: what a small cache evicts reaches Redis in
    both groups, and a fresh engine that loads it gives an engine without the
    connector's tokens."""
    other = sample_prompts(4, 420, seed=7)
    with EmbeddedRedis() as srv:
        plain = run_engine(work, "hyl_plain", hybrid_model, None, [{"op": "generate", "name": "g"}])
        small = run_lazy_small(work, "hyl_small", hybrid_model, srv.url, other, blocks=24)
        r = redis.Redis.from_url(srv.url)
        groups = {parse_key(k.decode()).group_id for k in r.scan_iter(match=value_pattern())}
        big = run_engine(
            work,
            "hyl_big",
            hybrid_model,
            connector(srv.url, store_mode="lazy"),
            [{"op": "generate", "name": "warm"}],
        )
        log = (work / "hyl_small.log").read_text() + (work / "hyl_big.log").read_text()
    assert "Traceback" not in log and "EngineDeadError" not in log
    want = tokens(plain["g"])
    for res, phase in ((small, "cold"), (small, "warm"), (big, "warm")):
        assert tokens(res[phase]) == want, phase
    assert small["after_other"] > 0 and groups == {0, 1}  # evicted blocks of both groups
    # The small cache evicted every block of the first prompts (both groups' blocks went
    # to Redis on their way out): the fresh engine hits every prompt block.
    for o in big["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    leak = small["leak"]
    assert leak["staging_in_use"] == 0 and leak["tracked_requests"] == 0
    assert leak["pinned_blocks"] == leak["lazy_pending"]


@pytest.fixture(scope="module")
def wide_model() -> Path:
    """The tiny Llama with 8 KV heads: 256 KiB a layer's page, so its objects of 2
    layers are stored in 2 parts and sync loads run by layer."""
    from conftest import CACHE

    from umbp_redis.testing.tiny_model import TinyModelSpec, build_tiny_llama

    spec = TinyModelSpec(hidden_size=512, num_attention_heads=8, num_kv_heads=8)
    return build_tiny_llama(CACHE / "tiny-llama-wide", spec)


@pytest.mark.parametrize("eager", [True, False], ids=["eager", "compiled"])
def test_loads_by_layer_in_a_real_engine_give_the_tokens_of_recomputing(
    work: Path, wide_model: Path, eager: bool
) -> None:
    """vLLM's attention layers wait for each layer's part (wait_for_layer_load), eager
    or in vLLM's compiled CPU graph: a warm engine loading every hit by layer
    (load_async auto) produces the tokens it computed cold, every load whole and none
    failed; damaged values fail only their loads, are replaced, and the tokens stay the
    same."""
    with EmbeddedRedis() as srv:
        url = srv.url
        phases = [
            {"op": "generate", "name": "cold"},
            {"op": "count_keys", "url": url, "name": "keys_cold"},
            {"op": "reset"},
            {"op": "generate", "name": "warm"},
            {"op": "load_totals", "name": "after_warm"},
            {"op": "corrupt", "url": url, "name": "corrupted"},
            {"op": "reset"},
            {"op": "generate", "name": "after_corrupt"},
            {"op": "load_totals", "name": "after_corrupt_loads"},
            {"op": "validate", "url": url, "name": "valid_after"},
        ]
        res = run_engine(
            work,
            f"by_layer_{eager}",
            wide_model,
            # The loads themselves are under test: every hit loads, even where this small
            # model computes its tokens as fast as they load (decline_slow_loads would
            # recompute them, rightly).
            connector(url, load_async="auto", decline_slow_loads=False),
            phases,
            enforce_eager=eager,
        )
        r = redis.Redis.from_url(url)
        fields = r.hkeys(next(r.scan_iter(match=value_pattern())))
    log = (work / f"by_layer_{eager}.log").read_text()
    assert "loads of at most" in log and "did not wait for every layer" not in log
    assert sorted(fields) == [b"b", b"b1", b"h"]  # value format 3: a part per layer
    cold = tokens(res["cold"])
    assert tokens(res["warm"]) == cold and tokens(res["after_corrupt"]) == cold
    for o in res["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    warm = res["after_warm"]
    assert warm["loads"] >= 1 and warm["sync_loads"] == warm["loads"]
    assert warm["load_failures"] == 0 and warm["blocks_loaded"] == res["keys_cold"]
    after = res["after_corrupt_loads"]
    assert after["load_failures"] >= 1  # the damaged values failed their loads ...
    # ... and were replaced by good ones.
    assert res["valid_after"]["valid"] == res["valid_after"]["keys"] == res["keys_cold"]
