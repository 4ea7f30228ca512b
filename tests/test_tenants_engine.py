"""Tenants on one Redis: a namespace each (``key_namespace``) and a Redis ACL user each,
limited to its namespace's keys with the commands docs/operations.md lists (the ACL
below is that text). Real vLLM engines (CPU, the tiny model) against a real
redis-server: a tenant's engines hit their own blocks; an engine logged in as another
tenant cannot read or write them (refused by Redis: misses, counted, logged at ERROR),
with the same tokens. Tenants that share a namespace are kept apart by ``cache_salt``
(``test_router_events``)."""

from __future__ import annotations

import re
from fnmatch import fnmatchcase
from pathlib import Path

import pytest
import redis
from helpers import connector, run_engine, tokens

from umbp_redis.data import namespace_pattern
from umbp_redis.testing.embedded_redis import EmbeddedRedis
from umbp_redis.testing.tiny_model import sample_prompts

pytestmark = pytest.mark.vllm

PROMPTS = sample_prompts(2, 330, seed=211)
DOCS = Path(__file__).resolve().parent.parent / "docs" / "operations.md"


def tenant_acl(tenant: str, password: str) -> list[str]:
    """``ACL SETUSER``'s arguments (user name and rules) of the documented tenant ACL
    (docs/operations.md, "Tenants") for ``tenant``."""
    text = DOCS.read_text()
    (line,) = re.findall(r"^ACL SETUSER TENANT .*$", text, flags=re.M)
    line = line.replace("TENANT", tenant).replace("SECRET", password)
    return line.split()[2:]  # after "ACL SETUSER"


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("tenants")


def test_a_tenant_acl_admits_its_own_namespace_and_refuses_anothers(
    work: Path, tiny_model: Path
) -> None:
    with EmbeddedRedis() as srv:
        admin = redis.Redis(port=srv.port)
        for tenant, pw in (("tenant-a", "pw-a"), ("tenant-b", "pw-b")):
            admin.execute_command("ACL", "SETUSER", *tenant_acl(tenant, pw))
        base = run_engine(
            work, "base", tiny_model, None, [{"op": "generate", "name": "g", "prompts": PROMPTS}]
        )
        url_a = f"redis://tenant-a@127.0.0.1:{srv.port}/0"
        own = run_engine(
            work,
            "tenant_a",
            tiny_model,
            connector(url_a, key_namespace="tenant-a"),
            [
                {"op": "generate", "name": "cold", "prompts": PROMPTS, "settle_s": 2.0},
                {"op": "generate", "name": "carry", "prompts": PROMPTS[:1]},
                {"op": "reset"},
                {"op": "generate", "name": "warm", "prompts": PROMPTS},
            ],
            env={"UMBP_REDIS_PASSWORD": "pw-a"},
        )
        keys_a = sorted(admin.scan_iter(match="*", count=1000))
        # Tenant b's user, pointed at tenant a's namespace: Redis refuses every command.
        url_b = f"redis://tenant-b@127.0.0.1:{srv.port}/0"
        other = run_engine(
            work,
            "tenant_b",
            tiny_model,
            connector(url_b, key_namespace="tenant-a"),
            [
                {"op": "generate", "name": "g", "prompts": PROMPTS, "settle_s": 2.0},
                {"op": "generate", "name": "again", "prompts": PROMPTS[:1]},
            ],
            env={"UMBP_REDIS_PASSWORD": "pw-b"},
        )
        keys_after = sorted(admin.scan_iter(match="*", count=1000))
        log_b = (work / "tenant_b.log").read_text()
    want = tokens(base["g"])
    assert tokens(own["cold"]) == tokens(own["warm"]) == want
    assert all(o["cached"] >= 256 for o in own["warm"]["outputs"])  # hits from Redis
    own_keys = namespace_pattern("tenant-a")
    assert keys_a and all(fnmatchcase(k.decode(), own_keys) for k in keys_a)
    assert any(k.endswith(b":model") for k in keys_a)  # the namespace record too
    # The other tenant's engine: same tokens, nothing from Redis, nothing written.
    assert tokens(other["g"]) == want
    assert [o["cached"] for o in other["g"]["outputs"]] == [0] * len(PROMPTS)
    assert keys_after == keys_a
    refusals = [ln for ln in log_b.splitlines() if "NOPERM" in ln or "no rights" in ln]
    assert refusals and all("ERROR" in ln for ln in refusals), refusals[:3]
    assert "pw-b" not in log_b and "pw-a" not in log_b
