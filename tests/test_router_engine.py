"""Behind vLLM's own router (the ``vllm-router`` binary, ``kv_aware``): a block one engine
stored in Redis is announced on the other engine's KV events as an external tier, the
router credits that engine with it and, with the first engine loaded, sends it the
prompt, which it loads from Redis and answers with the same tokens."""

from __future__ import annotations

import json
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from helpers import skip_without_vllm_router
from waiting import wait_until

from umbp_redis.bench.fleet_engines import EngineSpec, start_engines, stop_engines
from umbp_redis.bench.vllm_router import RouterWorker, kv_events_config, start_vllm_router
from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port

pytestmark = pytest.mark.vllm

BS = 128  # the CPU backend's block size, given to the engines and the router alike
PREFIX_BLOCKS = 4
# vllm-router's credit for an external block (--kv-penalty-external's default).
EXTERNAL_CREDIT = 0.6
_DECISION = re.compile(r"KV prefix decision.*")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _complete(base_url: str, model: str, prompt: list[int], max_tokens: int) -> dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    req = urllib.request.Request(
        base_url + "/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _decisions(log_path: Path) -> list[dict[str, str]]:
    """The router's kv_aware decisions (debug log): worker, credited tokens, outcome."""
    out = []
    for line in log_path.read_text(errors="replace").splitlines():
        m = _DECISION.search(_ANSI.sub("", line))
        if m:
            out.append(dict(re.findall(r'(\w+)="?([^"\s]*)"?', m.group(0))))
    return out


def test_a_block_stored_by_one_engine_is_credited_to_the_other_and_routed_there(
    tiny_model: Path, tmp_path: Path
) -> None:
    skip_without_vllm_router()
    import msgspec
    import zmq
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    model = str(tiny_model)
    server = EmbeddedRedis().start()
    ports = [(free_port(), free_port()) for _ in range(2)]
    # decline_slow_loads off: the tiny model computes a block about as fast as it loads,
    # and this test is about where the router sends a prompt, not the load-or-compute
    # choice (tests/test_load_or_compute.py tests that).
    ktc: dict[str, object] = {
        "kv_connector": "UMBPRedisConnector",
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"redis_url": server.url, "decline_slow_loads": False},
    }
    specs = [
        EngineSpec(
            model,
            64,
            str(i),
            ktc,
            max_model_len=2048,
            block_size=BS,
            kv_events_config=kv_events_config(*ports[i]),
        )
        for i in range(2)
    ]
    engines = start_engines(specs, tmp_path)
    a, b = engines
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)  # the test's own subscriber of B's events, beside the router
    sub.connect(f"tcp://127.0.0.1:{ports[1][0]}")
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    router = None
    try:
        router = start_vllm_router(
            [
                RouterWorker(e.base_url, f"tcp://127.0.0.1:{p}", f"tcp://127.0.0.1:{r}")
                for e, (p, r) in zip(engines, ports, strict=True)
            ],
            "kv_aware",
            BS,
            model,
            tmp_path / "router.log",
            ["--log-level", "debug"],
        )
        rnd = random.Random(5)
        prefix = [rnd.randrange(3, 500) for _ in range(PREFIX_BLOCKS * BS)]
        assert _complete(a.base_url, model, prefix + [7], 1)["usage"]["prompt_tokens"] > 0
        # B announces A's blocks at its next steps (an idle engine publishes nothing):
        # B serves other small requests until its events carry them.
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        relayed: list[Any] = []

        def relayed_all() -> bool:
            _complete(b.base_url, model, [rnd.randrange(3, 500) for _ in range(8)], 1)
            while sub.poll(200):
                batch = decoder.decode(sub.recv_multipart()[-1])
                relayed.extend(
                    e
                    for e in batch.events
                    if isinstance(e, BlockStored) and e.token_ids[0] in prefix
                )
            return len(relayed) >= PREFIX_BLOCKS

        wait_until(relayed_all, 60, what=lambda: f"A's blocks on B's events (so far {relayed})")
        assert [e.token_ids for e in relayed] == [
            prefix[i * BS : (i + 1) * BS] for i in range(PREFIX_BLOCKS)
        ]
        assert {(e.medium, e.locality, e.ownership) for e in relayed} == {
            ("REDIS", "REMOTE", "umbp-redis")
        }
        # Requests sharing the prefix, all at once through the router: A holds the prefix
        # in its own memory and wins the first ones; as they pile up on A, B, credited
        # with the prefix at the external rate, costs less and gets the rest.
        prompts = [prefix + [rnd.randrange(3, 500) for _ in range(5)] for _ in range(16)]
        with ThreadPoolExecutor(len(prompts)) as pool:
            routed = list(pool.map(lambda p: _complete(router.base_url, model, p, 48), prompts))
        decisions = _decisions(router.log_path)
        credited_b = [
            int(d["credited_prefix_tokens"])
            for d in decisions
            if d.get("worker") == b.base_url and "credited_prefix_tokens" in d
        ]
        assert credited_b, f"the router never sent B a prompt: {decisions}"
        assert int(EXTERNAL_CREDIT * PREFIX_BLOCKS * BS) in credited_b, decisions
        loaded = b.metrics()["vllm:external_prefix_cache_hits_total"]
        assert loaded >= PREFIX_BLOCKS * BS  # B loaded the prefix from Redis
        # The same tokens as A computes for the same prompts.
        for p, got in zip(prompts, routed, strict=True):
            assert (
                _complete(a.base_url, model, p, 48)["choices"][0]["text"]
                == (got["choices"][0]["text"])
            )
    finally:
        sub.close(0)
        ctx.term()
        if router is not None:
            router.stop()
        stop_engines(engines)
        server.cleanup()
