"""The prefix-lookup service against real engines (CPU, the tiny model): its answer for a
prompt equals the ``num_cached_tokens`` a fresh engine then reports for it. Cold, no
engine has published the model (an unknown model); warm, after an engine stored
prompts: whole prompts, a salted one, a prompt that continues a stored one, another
tenant's salt and a prompt nobody stored. On one Redis server and on a Redis Cluster."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import connector, run_engine

from umbp_redis.router.prefix_lookup import CacheLookup, UnknownModel
from umbp_redis.testing.embedded_cluster import EmbeddedCluster
from umbp_redis.testing.embedded_redis import EmbeddedRedis
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm

STORED = sample_prompts(3, 330, seed=101)
UNSEEN = sample_prompts(1, 300, seed=102)
LONGER = [STORED[0] + " " + sample_prompts(1, 200, seed=103)[0]]
# (prompt, cache_salt): what the service is asked and the fresh engine then serves.
QUERIES: list[tuple[str, str | None]] = [
    *((p, None) for p in STORED),
    (STORED[1], "tenant-a"),  # stored with this salt
    (STORED[2], "tenant-b"),  # stored without a salt: another tenant finds nothing
    (LONGER[0], None),  # continues a stored prompt: its stored blocks hit
    (UNSEEN[0], None),
]


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("lookup_service")


def _served(res: dict[str, Any]) -> list[tuple[int, int]]:
    """(prompt tokens, cached tokens) of each query, in order."""
    out = []
    for i in range(len(QUERIES)):
        (o,) = res[f"q{i}"]["outputs"]
        out.append((o["prompt_tokens"], o["cached"]))
    return out


def _fresh_engine_phases() -> list[dict[str, Any]]:
    """Each query alone, the local prefix cache reset before it: a fresh engine each."""
    phases: list[dict[str, Any]] = []
    for i, (prompt, salt) in enumerate(QUERIES):
        phases += [
            {"op": "reset"},
            {"op": "generate", "name": f"q{i}", "prompts": [prompt], "cache_salt": salt},
        ]
    return phases


def _answers(url: str, model: Path, cluster: bool) -> list[tuple[int, int]]:
    lookup = CacheLookup(url)
    try:
        assert lookup.settings.cluster == "auto"
        answers = [lookup.lookup(str(model), text=p, cache_salt=salt) for p, salt in QUERIES]
        assert all(len(a.namespaces) == 1 for a in answers)
        assert (lookup._plane.lookup_mode == "cluster") == cluster
        return [(a.prompt_tokens, a.cached_tokens) for a in answers]
    finally:
        lookup.close()


@pytest.mark.parametrize("deployment", ["standalone", "cluster"])
def test_the_answer_is_what_a_fresh_engine_takes_from_redis(
    work: Path, tiny_model: Path, deployment: str
) -> None:
    server = EmbeddedCluster() if deployment == "cluster" else EmbeddedRedis()
    with server as srv:
        url = srv.url
        # Cold: no engine has run, so no namespace serves the model.
        lookup = CacheLookup(url)
        with pytest.raises(UnknownModel):
            lookup.lookup(str(tiny_model), text=STORED[0])
        lookup.close()
        stored = run_engine(
            work,
            f"{deployment}_store",
            tiny_model,
            connector(url),
            [
                {"op": "generate", "name": "plain", "prompts": STORED},
                {
                    "op": "generate",
                    "name": "salted",
                    "prompts": [STORED[1]],
                    "cache_salt": "tenant-a",
                },
                {"op": "generate", "name": "carry", "prompts": STORED[:1]},  # last reports
            ],
        )
        assert stored["plain"]["outputs"]
        warm = _answers(url, tiny_model, deployment == "cluster")
        # It stores nothing, and loads every hit whole: this test compares the service's
        # answer with what the engine loads, so neither a declined hit (the tiny model
        # computes a block about as fast as it loads) nor a sync load's deadline on a busy
        # machine may turn a hit into a recompute (both are tested on their own).
        consumer = {
            **connector(url, decline_slow_loads=False, load_async=True),
            "kv_role": "kv_consumer",
        }
        served = _served(
            run_engine(work, f"{deployment}_fresh", tiny_model, consumer, _fresh_engine_phases())
        )
    # The service tokenizes as the engine does, and answers what the engine then loads.
    assert [t for t, _ in warm] == [t for t, _ in served]
    assert warm == served
    full = [(t - 1) // 128 * 128 for t, _ in served]
    # Warm: whole stored prompts and the salted one, the stored head of the longer one;
    # nothing for another tenant's salt or a prompt nobody stored.
    cached = [c for _, c in warm]
    assert cached[:4] == full[:4] and all(c > 0 for c in full[:4])
    assert cached[4] == 0 and cached[6] == 0 and 0 < cached[5] < full[5]
