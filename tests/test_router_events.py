"""The shared tier as a router sees it: real vLLM engines (CPU, the tiny models) publish
KV events over ZMQ, a subscriber rebuilds every block hash the connector announced from
the events alone (tokens, parent, extra keys) with vLLM's own hashing, as a router's
index does; and tenants (``cache_salt``) never share a block."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import BLOCK, connector, run_engine, tokens

from umbp_redis.testing.embedded_redis import EmbeddedRedis, free_port
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm

# Prompts that share nothing: every prompt block hit comes from Redis or not at all.
DISTINCT = sample_prompts(3, 330, seed=77)


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("router_events")


def _tagged(extra_keys: list[Any] | None) -> tuple[Any, ...] | None:
    """A block's published (untagged) extra keys as vLLM hashed them; these tests use
    no LoRA, multimodal input or prompt embeddings, so a string is a ``cache_salt``."""
    if not extra_keys:
        return None
    assert all(isinstance(k, str) for k in extra_keys), extra_keys
    return tuple(("cache_salt", k) for k in extra_keys)


def rebuild_hashes(events: list[dict[str, Any]]) -> dict[Any, bytes]:
    """Every announced block's full hash, computed from the events alone with vLLM's
    hashing (sha256, the default seed), each checked against the event's hash; raises
    AssertionError for an event whose hash the router cannot reproduce."""
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import (
        hash_block_tokens,
        init_none_hash,
        maybe_convert_block_hash,
    )

    init_none_hash(sha256)
    full: dict[Any, bytes] = {}
    pending = list(events)
    while pending:
        left = []
        for ev in pending:
            if ev["parent"] is not None and ev["parent"] not in full:
                left.append(ev)  # its parent is announced later in this list
                continue
            parent = full[ev["parent"]] if ev["parent"] is not None else None
            (extra,) = ev["extra_keys"]
            h = hash_block_tokens(sha256, parent, ev["token_ids"], _tagged(extra))  # type: ignore[arg-type]
            (announced,) = ev["hashes"]
            assert maybe_convert_block_hash(h) == announced, ev
            full[announced] = bytes(h)
        assert len(left) < len(pending), f"parents never announced: {left}"
        pending = left
    return full


def _redis_stored(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in events if e["medium"] == "REDIS" and e["type"] == "BlockStored"]


def test_a_router_rebuilds_every_announced_block_and_tenants_never_share(
    work: Path, tiny_model: Path
) -> None:
    with EmbeddedRedis() as srv:
        base = run_engine(
            work, "base", tiny_model, None, [{"op": "generate", "name": "g", "prompts": DISTINCT}]
        )
        # No waits between phases: the runner waits for each pass's stores to be
        # reported and reads the events back through the publisher's replay (none is
        # lost to a subscriber that joined late).
        phases: list[dict[str, Any]] = [
            {"op": "generate", "name": "plain", "prompts": DISTINCT},
            {"op": "generate", "name": "salt_a", "prompts": DISTINCT, "cache_salt": "tenant-a"},
            {"op": "generate", "name": "carry", "prompts": DISTINCT[:1]},  # last reports
            {"op": "kv_events", "name": "events"},
            {"op": "reset"},
            {"op": "generate", "name": "salt_b", "prompts": DISTINCT, "cache_salt": "tenant-b"},
            {"op": "reset"},
            {
                "op": "generate",
                "name": "salt_a_again",
                "prompts": DISTINCT,
                "cache_salt": "tenant-a",
            },
            {"op": "reset"},
            {"op": "generate", "name": "plain_again", "prompts": DISTINCT},
        ]
        res = run_engine(
            work, "router", tiny_model, connector(srv.url), phases, kv_events_port=free_port()
        )
    for name in ("plain", "salt_a", "salt_b", "salt_a_again", "plain_again"):
        assert tokens(res[name]) == tokens(base["g"]), name
    full_blocks = [(o["prompt_tokens"] - 1) // BLOCK * BLOCK for o in res["plain"]["outputs"]]
    # Tenants: another salt finds nothing; the same salt, or none, finds every block.
    assert [o["cached"] for o in res["salt_a"]["outputs"]] == [0] * len(DISTINCT)
    assert [o["cached"] for o in res["salt_b"]["outputs"]] == [0] * len(DISTINCT)
    assert [o["cached"] for o in res["salt_a_again"]["outputs"]] == full_blocks
    assert [o["cached"] for o in res["plain_again"]["outputs"]] == full_blocks

    stored = _redis_stored(res["events"])
    assert len(stored) == 2 * sum(full_blocks) // BLOCK  # plain and tenant-a, once each
    for ev in stored:
        assert ev["locality"] == "REMOTE" and ev["block_size"] == BLOCK
        assert (ev["group_idx"], ev["kv_cache_spec_kind"]) == (0, "full_attention")
        assert ev["kv_cache_spec_sliding_window"] is None and ev["lora_name"] is None
    full = rebuild_hashes(stored)
    assert len(full) == len(stored)
    salted = [e for e in stored if e["extra_keys"] != [None]]
    # Only each salted prompt's first block carries the salt, as in vLLM's own events.
    assert [e["extra_keys"] for e in salted] == [[["tenant-a"]]] * len(DISTINCT)
    assert all(e["parent"] is None for e in salted)
    # vLLM's own (GPU-medium, LOCAL) events for the same blocks agree on every hash.
    local = {
        h
        for e in res["events"]
        if e["medium"] != "REDIS" and e["type"] == "BlockStored"
        for h in e["hashes"]
    }
    assert {h for e in stored for h in e["hashes"]} <= local


def test_a_router_rebuilds_the_blocks_of_a_hybrid_model(work: Path, hybrid_model: Path) -> None:
    with EmbeddedRedis() as srv:
        phases: list[dict[str, Any]] = [
            {"op": "generate", "name": "g", "prompts": DISTINCT},
            {"op": "generate", "name": "carry", "prompts": DISTINCT[:1]},
            {"op": "kv_events", "name": "events"},
        ]
        res = run_engine(
            work, "hybrid", hybrid_model, connector(srv.url), phases, kv_events_port=free_port()
        )
    stored = _redis_stored(res["events"])
    kinds = {
        (e["group_idx"], e["kv_cache_spec_kind"], e["kv_cache_spec_sliding_window"]) for e in stored
    }
    assert {k[1:] for k in kinds} == {("sliding_window", 256), ("full_attention", None)}
    assert len({k[0] for k in kinds}) == 2  # one group each
    # A block's hash names it in every group: the window's blocks (only those before
    # hit points are stored) chain through the full-attention group's announcements.
    full = rebuild_hashes(stored)
    window = [e for e in stored if e["kv_cache_spec_kind"] == "sliding_window"]
    assert window and {h for e in window for h in e["hashes"]} <= set(full)
