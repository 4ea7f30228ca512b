"""Helpers shared by the test modules: vLLM configs, the CLI, the documented ACL, model
weights, and engines run through ``engine_runner.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
from vllm.config import KVTransferConfig, ModelConfig, ParallelConfig, VllmConfig
from waiting import wait_until

from umbp_redis.store.deployment import open_plane
from umbp_redis.store.plane import StoreStatus
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.tiny_model import sample_prompts

# The layout fingerprint of the values ``fill`` stores.
FP = b"\x11" * 16


def make_vllm_config(
    model_config: ModelConfig, *, tp: int = 1, extra: dict | None = None, **model_kw
) -> VllmConfig:  # type: ignore[type-arg]
    mc = model_config
    if model_kw:
        mc = ModelConfig(
            model=model_config.model, max_model_len=1024, **{"dtype": "bfloat16", **model_kw}
        )
    cfg = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp))
    # Set after construction: VllmConfig would import the connector module to validate it.
    cfg.kv_transfer_config = KVTransferConfig(
        kv_connector="UMBPRedisConnector", kv_role="kv_both", kv_connector_extra_config=extra or {}
    )
    return cfg


def ktc(cfg: VllmConfig) -> KVTransferConfig:
    """The connector's transfer config of ``cfg`` (set by ``make_vllm_config``)."""
    assert cfg.kv_transfer_config is not None
    return cfg.kv_transfer_config


def cli(*args: str, input_text: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "umbp_redis.cli", *args],
        capture_output=True,
        text=True,
        timeout=120,
        input=input_text,
    )


def fill(
    url: str,
    ns: str,
    n: int,
    size: int = 4096,
    checksum: bool = True,
    parts: tuple[int, ...] | None = None,
) -> list[str]:
    plane = open_plane(RedisSettings.from_url(url, checksum=checksum))
    keys = [f"umbp:vllm:v2:{ns}:tp0:pcp0:dcp0:pp0:g0:{i:064x}" for i in range(n)]
    data = np.random.default_rng(0).integers(0, 256, (n, size), dtype=np.uint8)
    stored = plane.store(list(zip(keys, data, strict=True)), FP, parts=parts)
    assert set(stored) == {StoreStatus.STORED}
    plane.close()
    return keys


def documented_acl() -> list[str]:
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    rule = next(ln for ln in doc.splitlines() if ln.startswith("ACL SETUSER umbp "))
    return rule.replace(">SECRET", ">acl-pass").split()


def rewrite_weights(model_dir: Path, seed: int) -> None:
    """Save new random weights of the same shapes at the same path."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model: Any = LlamaForCausalLM(LlamaConfig.from_pretrained(model_dir))
    model = model.to(dtype=torch.bfloat16)
    model.save_pretrained(model_dir, safe_serialization=True)


RUNNER = Path(__file__).with_name("engine_runner.py")
BLOCK = 128  # vLLM 0.32's CPU block size
PROMPTS = sample_prompts(4, 420, seed=1, shared_prefix_words=300)


def connector(url: str, *, module_path: bool = True, **extra: Any) -> dict[str, Any]:
    """The connector's ``--kv-transfer-config`` for an engine test: the shipped defaults
    with ``redis_url``; ``extra`` options only where a test is about them (each caller
    says why)."""
    return {
        "kv_connector": "UMBPRedisConnector",
        **({"kv_connector_module_path": "umbp_redis.connector"} if module_path else {}),
        "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"redis_url": url, **extra},
    }


# Each engine run of this session: the test file that asked for it, and its seconds.
ENGINE_STARTS: list[tuple[str, float]] = []

# Results of engines without the connector, by their spec: one engine start for the
# same plain run asked by several test modules.
_PLAIN_RUNS: dict[str, dict[str, Any]] = {}


def run_engine(
    tmp: Path,
    name: str,
    model: Path,
    conn: dict | None,
    phases: list,
    env: dict | None = None,
    **spec: Any,
) -> dict:  # type: ignore[type-arg]
    """Run ``engine_runner.py`` with ``model``, connector config ``conn`` (None: no
    connector) and ``phases``; return its results (the log is left as ``{name}.log``
    in ``tmp``). A run without the connector and of only ``generate`` phases is run
    once per session for the same model, prompts, phases, environment and spec."""
    full = {"model": str(model), "connector": conn, "prompts": PROMPTS, "phases": phases, **spec}
    plain = conn is None and all(p["op"] == "generate" for p in phases)
    memo = json.dumps([full, env], sort_keys=True) if plain else ""
    if memo in _PLAIN_RUNS:
        return json.loads(json.dumps(_PLAIN_RUNS[memo]))  # a copy the caller may change
    out = tmp / f"{name}.json"
    spec_path = tmp / f"{name}.spec.json"
    spec_path.write_text(json.dumps({**full, "out": str(out)}))
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, str(RUNNER), str(spec_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, **(env or {})},
    )
    test = os.environ.get("PYTEST_CURRENT_TEST", "?").split("::", 1)[0]
    ENGINE_STARTS.append((test, time.monotonic() - started))
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"engine {name} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    (tmp / f"{name}.log").write_text(proc.stdout + proc.stderr)
    result: dict[str, Any] = json.loads(out.read_text())
    if plain:
        _PLAIN_RUNS[memo] = result
        return json.loads(json.dumps(result))
    return result


def tokens(result: dict) -> list[list[int]]:  # type: ignore[type-arg]
    return [o["tokens"] for o in result["outputs"]]


def full_blocks(prompt_tokens: int) -> int:
    return (prompt_tokens - 1) // BLOCK


def check_stored_markers(plane: Any, client: Any, ttl: int = 100) -> None:
    """The stored-marker job against a real data plane (``client``: a redis-py client of
    the same server or cluster): markers written once both ranks reported, not for a
    block whose rank key failed, with the TTL; a found prefix's values refreshed to the
    TTL once due; a block whose rank value is gone loses its marker."""
    from umbp_redis.data import BlockIdentityCodec, RankTopology
    from umbp_redis.engine.block_markers import StoredMarkers

    codec = BlockIdentityCodec("markers", RankTopology(tp_size=2))
    markers = StoredMarkers(plane, 2, ttl_s=ttl, refresh_ttl=True, timeout_s=5.0)
    hashes = [bytes([i]) * 32 for i in range(40)]

    def marker(i: int) -> str:
        return codec.marker_prefix(0) + hashes[i].hex()

    for h in hashes:  # every rank's value (plain strings: markers never read values)
        for k in codec.rank_keys(h, 0):
            client.set(k, b"v", ex=5)
    markers.track(1, hashes, [0] * len(hashes))
    markers.note_store_report(codec, 1, 1, frozenset())
    assert markers.flush(10) and not client.exists(marker(0))  # one rank of two reported
    markers.note_store_report(codec, 1, 1, frozenset({codec.rank_keys(hashes[3], 0)[1]}))
    assert markers.flush(10)
    assert [client.exists(marker(i)) for i in range(40)] == [int(i != 3) for i in range(40)]
    assert ttl - 10 < client.ttl(marker(0)) <= ttl
    client.delete(codec.rank_keys(hashes[5], 0)[0])  # evicted, say
    # Values the writer just marked were stored with the TTL: no refresh is due yet.
    markers.note_found(codec, 10, lambda b: hashes[b], [0], lambda b, pos: b != 3)
    assert markers.flush(10) and client.ttl(codec.rank_keys(hashes[0], 0)[1]) <= 5
    markers.refresh_interval_s = 0.0  # as if the interval had passed
    markers.note_found(codec, 10, lambda b: hashes[b], [0], lambda b, pos: b != 3)
    assert markers.flush(10)
    assert client.ttl(codec.rank_keys(hashes[0], 0)[1]) > ttl - 10  # refreshed from 5 s
    assert client.ttl(codec.rank_keys(hashes[20], 0)[1]) <= 5  # not found: not refreshed
    assert not client.exists(marker(5)) and client.exists(marker(6))
    assert (markers.written, markers.stale, markers.failed) == (39, 1, 0)
    markers.close()


def check_fleet_feed(plane: Any, client: Any) -> None:
    """Two engines' fleet block feeds against a real data plane (``client``: a redis-py
    client of the same server or cluster): what A announces reaches B's events as
    external blocks (its own entries never come back to A), B's credits follow A's
    removals and the markers' disappearance, and a late engine C learns only the blocks
    whose markers are still there."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    from umbp_redis.data import BlockIdentityCodec
    from umbp_redis.engine.fleet_blocks import FleetBlockFeed
    from umbp_redis.engine.kv_events import EventBlock, GroupSpecInfo

    codec = BlockIdentityCodec("fleet")
    specs = {0: GroupSpecInfo("full_attention", None)}

    def feed(name: str) -> FleetBlockFeed:
        f = FleetBlockFeed(
            plane,
            codec,
            name,
            4,
            specs,
            ttl_s=100,
            timeout_s=5.0,
            poll_interval_s=0.01,
            verify_interval_s=0.05,
            verify_grace_s=0.0,
        )
        f.start()
        return f

    raw = [bytes([i + 1]) * 32 for i in range(6)]
    hashes: list[Any] = [maybe_convert_block_hash(h) for h in raw]  # type: ignore[arg-type]
    blocks = [
        EventBlock(
            h,
            raw[i - 1] if i else None,
            tuple(range(4 * i, 4 * i + 4)),
            0,
            ("salt-a",) if i == 0 else None,
        )
        for i, h in enumerate(raw)
    ]
    for h in raw[:5]:  # block 5 is announced but its marker never written
        client.set(codec.marker_key(h, 0), b"1", ex=100)
    a, b = feed("engine-a"), feed("engine-b")
    wait_for_events(b, lambda evs: b.caught_up)  # what A announces next is live for B
    stored = wait_for_events(
        b,
        lambda evs: sum(e.block_hashes[0] in hashes for e in evs) >= 6,
        lambda: a.announce_stored(blocks),
    )
    by_hash = {e.block_hashes[0]: e for e in stored if type(e).__name__ == "BlockStored"}
    assert sorted(by_hash) == sorted(hashes)
    for i, h in enumerate(hashes):
        ev = by_hash[h]
        assert (ev.ownership, ev.medium, ev.locality) == ("umbp-redis", "REDIS", "REMOTE")
        assert ev.parent_block_hash == (hashes[i - 1] if i else None)
        assert ev.token_ids == list(range(4 * i, 4 * i + 4)) and ev.block_size == 4
        assert ev.extra_keys == [("salt-a",) if i == 0 else None]
        assert ev.kv_cache_spec_kind == "full_attention" and ev.group_idx == 0
    assert b.credits((raw[0], 0)) and b.relayed == 6 and a.relayed == 0
    # A's own entries never come back as A's events; A's own marker check may already
    # have found block 5 without a marker (its removal is B's to see below).
    assert [e for e in a.take() if type(e).__name__ == "BlockStored"] == []
    # A finds block 0 gone (and its marker goes); block 5's marker never existed: the
    # check finds it.
    client.delete(codec.marker_key(raw[0], 0))
    removed = wait_for_events(
        b,
        lambda evs: {h for e in evs for h in e.block_hashes} >= {hashes[0], hashes[5]},
        lambda: a.announce_removed([raw[0]], [0]),
    )
    assert all(type(e).__name__ == "BlockRemoved" and e.ownership == "umbp-redis" for e in removed)
    client.delete(codec.marker_key(raw[1], 0))  # expired or evicted, say
    removed = wait_for_events(b, lambda evs: any(hashes[1] in e.block_hashes for e in evs))
    assert not b.credits((raw[1], 0)) and b.credits((raw[2], 0))
    # A late engine learns blocks 2-4: 0 and 1 were removed, 5 never had a marker.
    c = feed("engine-c")
    late = wait_for_events(c, lambda evs: len(evs) >= 3)
    assert sorted(e.block_hashes[0] for e in late) == sorted(hashes[2:5])
    assert a.failures == b.failures == c.failures == 0
    for f in (a, b, c):
        f.close()


def wait_for_events(
    feed: Any,
    done: Any,
    action: Any = None,
    timeout_s: float = 20.0,
) -> list[Any]:
    """Run ``action`` (if given), then take ``feed``'s events until ``done(events)``
    holds for all taken so far; fails after ``timeout_s``."""
    if action is not None:
        action()
    got: list[Any] = []

    def taken_enough() -> bool:
        got.extend(feed.take())
        return bool(done(got))

    wait_until(taken_enough, timeout_s, what=lambda: f"events (so far: {got})")
    return got


def skip_without_vllm_router() -> None:
    """Skip the calling test, with the reason, where the ``vllm-router`` binary is not
    installed (the ``router`` extra)."""
    import pytest

    from umbp_redis.bench.vllm_router import RouterMissingError, find_router_binary

    try:
        find_router_binary()
    except RouterMissingError as e:
        pytest.skip(str(e))


def run_bench_fleet(model: Path, work: Path, *args: str, timeout_s: float = 600) -> dict:  # type: ignore[type-arg]
    """``umbp-redis bench fleet --json`` of no-connector and umbp-redis on ``model``, 16
    blocks per engine, 4 answer tokens, one repeat, with ``args``; its JSON result (also
    written to ``work/fleet.json`` for a look after a failure)."""
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "umbp_redis.cli",
            "bench",
            "fleet",
            "--model",
            str(model),
            "--configs",
            "no-connector,umbp-redis",
            "--answer-tokens",
            "4",
            "--blocks",
            "16",
            "--repeats",
            "1",
            "--quiet",
            "--json",
            "--work-dir",
            str(work),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    (work / "fleet.json").write_text(out.stdout)
    return json.loads(out.stdout)  # type: ignore[no-any-return]
