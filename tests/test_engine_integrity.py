"""Never a wrong token: real vLLM engines (CPU, the tiny model) against real Redis.

Every generation is compared token for token with an engine without the connector.
The engines here leave ``kv_load_failure_policy`` at vLLM's default ("fail"): the
connector must make a bad or missing value a recompute all the same.

* Values moved to other keys, values without checksums, damaged bodies: misses,
  recomputed, and stored again (valid) by the engine that recomputed them.
* New weights at the same model path: a new namespace, nothing of the old one loads.
* Prefixes every request shares stay in a small LRU Redis that many suffixes overflow.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from helpers import BLOCK, PROMPTS, full_blocks, rewrite_weights, run_engine, tokens

from umbp_redis.testing.embedded_redis import EmbeddedRedis
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm

OBJECT_BYTES = 2 * 65536  # the tiny model: 2 layers x 64 KiB pages per block


def connector(url: str) -> dict[str, Any]:
    """The connector as a new user writes it: its defaults, no kv_load_failure_policy."""
    return {
        "kv_connector": "UMBPRedisConnector",
        "kv_connector_module_path": "umbp_redis.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"redis_url": url},
    }


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("integrity")


@pytest.fixture(scope="module")
def model_dir(work: Path, tiny_model: Path) -> Path:
    """A copy of the tiny model whose weights the tests replace in place."""
    dst = work / "model"
    shutil.copytree(tiny_model, dst)
    return dst


@pytest.fixture(scope="module")
def server() -> Any:
    with EmbeddedRedis() as s:
        yield s


@pytest.fixture(scope="module")
def baseline(work: Path, tiny_model: Path) -> dict:  # type: ignore[type-arg]
    """Tokens of the tiny model (the weights model_dir holds until a test rewrites them)."""
    return run_engine(work, "baseline1", tiny_model, None, [{"op": "generate", "name": "g"}])["g"]


@pytest.fixture(scope="module")
def integrity_run(
    work: Path,
    model_dir: Path,
    server: EmbeddedRedis,
    baseline: dict,  # type: ignore[type-arg]
) -> dict:  # type: ignore[type-arg]
    url = server.url

    def damage(op: str, after: str) -> list[dict[str, Any]]:
        """Damage every stored value, generate on a fresh local cache, validate."""
        return [
            {"op": op, "url": url, "name": f"{op}_count"},
            {"op": "reset"},
            {"op": "generate", "name": after},
            {"op": "validate", "url": url, "name": f"valid_{after}"},
        ]

    phases = [
        {"op": "generate", "name": "cold"},
        {"op": "count_keys", "url": url, "name": "n_cold"},
        *damage("swap", "after_swap"),
        {"op": "reset"},
        {"op": "generate", "name": "warm"},
        *damage("strip_checksum", "after_strip"),
        *damage("corrupt", "after_corrupt"),
        # A request whose sync load fails and that is aborted before vLLM recomputes the
        # blocks: vLLM had cached them before the load; they must not stay hits.
        {"op": "corrupt", "url": url, "name": "corrupt_again"},
        {"op": "reset"},
        {"op": "abort_after_one_step", "name": "aborted"},
        {"op": "generate", "name": "after_abort", "prompts": PROMPTS[:1]},
        {"op": "load_totals", "name": "loads"},
    ]
    return run_engine(
        work,
        "integrity",
        model_dir,
        connector(url),
        phases,
    )


def test_bad_values_are_misses_and_are_stored_again(
    integrity_run: dict,
    baseline: dict,
    work: Path,  # type: ignore[type-arg]
) -> None:
    res = integrity_run
    expected = tokens(baseline)
    for phase in ("cold", "after_swap", "warm", "after_strip", "after_corrupt"):
        assert tokens(res[phase]) == expected, phase
    n = res["n_cold"]
    assert n == 2 + len(PROMPTS) and res["swap_count"] == n
    # Every value was bad in each round; the engine recomputed and stored them again.
    for phase in ("valid_after_swap", "valid_after_strip", "valid_after_corrupt"):
        assert res[phase]["keys"] == n and res[phase]["valid"] == n, (phase, res[phase])
    # What it stored again is good: the next fresh prefix cache hits all of it.
    for o in res["warm"]["outputs"]:
        assert o["cached"] == full_blocks(o["prompt_tokens"]) * BLOCK
    # The default (load_async auto) loads the tiny model's hits before the step (sync).
    assert res["loads"]["sync_loads"] == res["loads"]["loads"] > 0
    # The aborted request's failed sync load left nothing in vLLM's prefix cache (its
    # damaged values were deleted from Redis): the same prompt computes everything.
    (after_abort,) = res["after_abort"]["outputs"]
    assert after_abort["cached"] == 0
    assert after_abort["tokens"] == expected[0]
    log = (work / "integrity.log").read_text()
    assert "kv_load_failure_policy was 'fail'; using 'recompute'" in log
    assert "Traceback" not in log


def test_new_weights_at_the_same_path_share_nothing_and_hot_prefixes_stay(
    work: Path,
    model_dir: Path,
    server: EmbeddedRedis,
    integrity_run: dict,  # type: ignore[type-arg]
) -> None:
    url = server.url
    old_namespace = integrity_run["valid_after_corrupt"]["namespaces"]
    rewrite_weights(model_dir, seed=99)
    # Three prefixes of two blocks; each prompt adds one block of its own.
    fill: list[list[str]] = [[], [], []]
    warm: list[str] = []
    for p, seed in enumerate((11, 12, 13)):
        prompts = sample_prompts(14, 420, seed=seed, shared_prefix_words=300)
        fill[p], warm = fill[p] + prompts[:12], warm + prompts[12:]
    rounds = [[fill[p][i] for p in range(3) for i in range(j, j + 3)] for j in (0, 3, 6, 9)]
    base = run_engine(
        work,
        "baseline2",
        model_dir,
        None,
        [{"op": "generate", "name": "g"}, {"op": "generate", "name": "warm", "prompts": warm}],
    )
    phases: list[dict[str, Any]] = [
        {"op": "generate", "name": "g"},
        {"op": "validate", "url": url, "name": "after_new_weights"},
        # A small LRU cache: room for about 24 objects; 6 shared + 36 unique are stored.
        {"op": "limit_memory", "url": url, "objects": 24, "object_bytes": OBJECT_BYTES},
    ]
    # Rounds on distinct ticks of Redis' LRU clock (a resolution of one second).
    for i, r in enumerate(rounds):
        phases += [
            {"op": "generate", "name": f"fill{i}", "prompts": r},
            {"op": "lru_tick", "url": url},
        ]
    phases += [
        {"op": "evicted", "url": url, "name": "evicted"},
        {"op": "reset"},
        {"op": "generate", "name": "warm", "prompts": warm},
    ]
    res = run_engine(
        work,
        "new_weights",
        model_dir,
        connector(url),
        phases,
    )
    # New weights: nothing of the old namespace loaded, a namespace of its own.
    assert tokens(res["g"]) == tokens(base["g"])
    assert res["g"]["outputs"][0]["cached"] == 0
    namespaces = res["after_new_weights"]["namespaces"]
    assert len(namespaces) == 2 and set(old_namespace) < set(namespaces)
    # Hot prefixes: evictions happened, yet the warm prompts load their shared prefixes.
    # Without the refresh the prefixes are the oldest keys (stored first, never touched
    # again: the engine's own prefix cache served them) and go first: no hit at all.
    # Redis' LRU is approximate (sampled keys, a one-second clock), so an unlucky block
    # may still go; most must stay.
    assert res["evicted"] > 0
    assert tokens(res["warm"]) == tokens(base["warm"])
    cached = [o["cached"] for o in res["warm"]["outputs"]]
    assert sum(cached) >= (2 * len(warm) * 2 * BLOCK) // 3, cached
