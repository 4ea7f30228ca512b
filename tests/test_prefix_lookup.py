"""The prefix-lookup service without an engine: namespace records, hashing against vLLM's
own request block hasher, and the Python, CLI and HTTP faces against a real
redis-server (markers written here as an engine would write them). The answers against
real engines are in ``test_lookup_service_engine``."""

from __future__ import annotations

import hashlib
import http.client
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from helpers import cli

from umbp_redis.data import BlockIdentityCodec, CacheGroupReach
from umbp_redis.data.lookup_record import NamespaceRecord, record_key
from umbp_redis.engine.namespace_advert import hashes_reproducible
from umbp_redis.router.http_service import make_server
from umbp_redis.router.prefix_lookup import (
    CacheLookup,
    CacheUnavailable,
    HashesNotReproducible,
    PromptHasher,
    UnknownModel,
)
from umbp_redis.store.settings import RedisSettings
from umbp_redis.testing.embedded_redis import free_port

BS = 16


def _none_hash_digest(algo: str = "sha256") -> str:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import resolve_none_hash_seed

    fn = get_hash_fn_by_name(algo)
    return hashlib.sha256(bytes(fn(resolve_none_hash_seed(fn)))).hexdigest()[:16]


def make_record(ns: str = "nsA", **kw: Any) -> NamespaceRecord:
    fields: dict[str, Any] = dict(
        namespace=ns,
        model="/models/tiny",
        tokenizer="/models/tiny",
        served_names=("tiny",),
        block_size=BS,
        hash_block_size=BS,
        hash_algo="sha256",
        reproducible=True,
        none_hash_digest=_none_hash_digest(),
        groups=(CacheGroupReach(0, "full_attention", BS, 0),),
    )
    fields.update(kw)
    return NamespaceRecord(**fields)


def test_a_record_round_trips_and_malformed_ones_are_refused() -> None:
    rec = make_record(
        groups=(
            CacheGroupReach(0, "full_attention", BS, 0),
            CacheGroupReach(1, "sliding_window", BS, 2),
        )
    )
    assert NamespaceRecord.from_json(rec.to_json()) == rec
    assert rec.serves("tiny") and rec.serves("/models/tiny") and not rec.serves("other")
    for bad in ("{", "[]", json.dumps({"version": 99}), rec.to_json().replace("16", "-16", 1)):
        with pytest.raises(ValueError, match="malformed|version"):
            NamespaceRecord.from_json(bad)
    with pytest.raises(ValueError, match="namespace"):
        NamespaceRecord.from_json(rec.to_json().replace('"nsA"', '"a:b"'))


@pytest.mark.parametrize("hash_block_size", [BS, BS // 4])
@pytest.mark.parametrize(
    "salt, lora", [(None, None), ("tenant-a", None), (None, ("adapter", "/loras/a"))]
)
def test_hashes_equal_vllms_request_block_hasher(
    hash_block_size: int, salt: str | None, lora: tuple[str, str] | None
) -> None:
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    tokens = list(range(1000, 1000 + 5 * BS + 7))
    req = Request(
        "r",
        tokens,
        SamplingParams(max_tokens=1),
        None,
        cache_salt=salt,
        lora_request=LoRARequest(lora[0], 1, lora[1]) if lora else None,
        block_hasher=get_request_block_hasher(hash_block_size, sha256),
    )
    scale = BS // hash_block_size
    want = [bytes(h) for h in req.block_hashes][scale - 1 :: scale]
    hasher = PromptHasher(make_record(hash_block_size=hash_block_size))
    assert hasher.block_hashes(tokens, cache_salt=salt, lora=lora) == want
    assert len(want) == 5


def test_hashes_that_cannot_be_reproduced_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    assert not hashes_reproducible("xxhash", {}) and hashes_reproducible(
        "xxhash", {"PYTHONHASHSEED": "1"}
    )
    assert hashes_reproducible("sha256", {})
    with pytest.raises(HashesNotReproducible, match="PYTHONHASHSEED") as ei:
        PromptHasher(make_record(hash_algo="xxhash", reproducible=False))
    assert ei.value.status == 409
    # Engines started with another PYTHONHASHSEED than this process: the digest differs.
    with pytest.raises(HashesNotReproducible, match="seed differs"):
        PromptHasher(make_record(none_hash_digest="0" * 16))


def _publish(url: str, rec: NamespaceRecord, tokens: list[int], blocks: int, **kw: Any) -> None:
    """Write ``rec`` and the stored markers of the first ``blocks`` blocks of ``tokens``
    (every group) as an engine would."""
    r = redis.Redis.from_url(url)
    r.set(record_key(rec.namespace), rec.to_json(), ex=600)
    codec = BlockIdentityCodec(rec.namespace)
    for h in PromptHasher(rec).block_hashes(tokens, **kw)[:blocks]:
        for g in rec.groups:
            r.set(codec.marker_key(h, g.group_id), b"1", ex=600)
    r.close()


def test_lookups_count_the_leading_blocks_every_group_holds(redis_url: str) -> None:
    tokens = list(range(7, 7 + 6 * BS))
    rec = make_record()
    _publish(redis_url, rec, tokens, 3)
    _publish(redis_url, make_record("nsB", served_names=("tiny", "alias")), tokens, 5)
    lookup = CacheLookup(redis_url)
    try:
        ans = lookup.lookup("tiny", token_ids=tokens)
        assert ans.prompt_tokens == len(tokens) and ans.cached_tokens == 5 * BS
        assert [(a.namespace, a.cached_tokens) for a in ans.namespaces] == [
            ("nsB", 5 * BS),
            ("nsA", 3 * BS),
        ]
        # Never the prompt's last token: 6 full blocks, the last one computed.
        assert lookup.lookup("alias", token_ids=tokens + [1]).cached_tokens == 5 * BS
        assert lookup.lookup("tiny", token_ids=tokens, namespace="nsA").cached_tokens == 3 * BS
        # Another tenant's salt, or the prompt changed in its first block: nothing.
        assert lookup.lookup("tiny", token_ids=tokens, cache_salt="b").cached_tokens == 0
        assert lookup.lookup("tiny", token_ids=[0, *tokens[1:]]).cached_tokens == 0
        with pytest.raises(UnknownModel, match="'nope'.*models known") as ei:
            lookup.lookup("nope", token_ids=tokens)
        assert ei.value.status == 404
    finally:
        lookup.close()


def test_a_sliding_window_group_needs_only_the_blocks_before_the_hit(redis_url: str) -> None:
    rec = make_record(
        "hyb",
        groups=(
            CacheGroupReach(0, "sliding_window", BS, 2),
            CacheGroupReach(1, "full_attention", BS, 0),
        ),
    )
    tokens = list(range(50, 50 + 5 * BS + 1))
    r = redis.Redis.from_url(redis_url)
    r.set(record_key(rec.namespace), rec.to_json())
    codec = BlockIdentityCodec(rec.namespace)
    hashes = PromptHasher(rec).block_hashes(tokens)
    for i, h in enumerate(hashes):
        r.set(codec.marker_key(h, 1), b"1")  # full attention: every block
        if i in (2, 3):  # the window: only the two blocks before a hit at block 4
            r.set(codec.marker_key(h, 0), b"1")
    lookup = CacheLookup(redis_url)
    try:
        assert lookup.lookup("tiny", token_ids=tokens).cached_tokens == 4 * BS
    finally:
        lookup.close()


def test_redis_down_is_unavailable_within_the_timeout() -> None:
    settings = RedisSettings.from_url(
        f"redis://127.0.0.1:{free_port()}/0", lookup_timeout_s=0.2, connect_timeout_s=0.2
    )
    lookup = CacheLookup(settings)
    try:
        with pytest.raises(CacheUnavailable) as ei:
            lookup.lookup("tiny", token_ids=[1, 2, 3])
        assert ei.value.status == 503
    finally:
        lookup.close()


@pytest.fixture
def server(redis_url: str) -> Iterator[tuple[str, int]]:
    tokens = list(range(7, 7 + 4 * BS))
    _publish(redis_url, make_record(), tokens, 2)
    lookup = CacheLookup(redis_url)
    srv = make_server(lookup, "127.0.0.1", 0)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv.server_address[0], srv.server_address[1]  # type: ignore[misc]
    finally:
        srv.shutdown()
        srv.server_close()
        lookup.close()


def _call(
    addr: tuple[str, int], method: str, path: str, body: bytes | None = None
) -> tuple[int, Any]:
    conn = http.client.HTTPConnection(*addr, timeout=10)
    conn.request(method, path, body=body, headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    out = resp.status, json.loads(resp.read())
    conn.close()
    return out


def test_http_answers_lookups_and_refuses_bad_input_with_a_4xx(server: tuple[str, int]) -> None:
    tokens = list(range(7, 7 + 4 * BS))
    status, ans = _call(
        server, "POST", "/lookup", json.dumps({"model": "tiny", "token_ids": tokens}).encode()
    )
    assert status == 200 and ans["cached_tokens"] == 2 * BS and ans["prompt_tokens"] == 4 * BS
    assert _call(server, "GET", "/health") == (200, {"ok": True})
    status, models = _call(server, "GET", "/models")
    assert status == 200 and [m["namespace"] for m in models["models"]] == ["nsA"]
    bad: list[tuple[bytes, int, str]] = [
        (b"{not json", 400, "not JSON"),
        (b"[1, 2]", 400, "JSON object"),
        (json.dumps({"model": "tiny"}).encode(), 400, "exactly one"),
        (json.dumps({"model": "tiny", "token_ids": ["a"]}).encode(), 400, "non-negative"),
        (json.dumps({"model": "tiny", "token_ids": [1], "x": 1}).encode(), 400, "unknown"),
        (json.dumps({"model": 5, "prompt": "hi"}).encode(), 400, "model"),
        (json.dumps({"model": "tiny", "prompt": "hi", "lora_name": "a"}).encode(), 400, "LoRA"),
        (json.dumps({"model": "other", "token_ids": [1]}).encode(), 404, "other"),
    ]
    for body, want, reason in bad:
        status, err = _call(server, "POST", "/lookup", body)
        assert (status, reason in err["error"]) == (want, True), (body, status, err)
    assert _call(server, "GET", "/nowhere")[0] == 404
    # A body over the limit is refused by its length alone, before it is read.
    conn = http.client.HTTPConnection(*server, timeout=10)
    conn.putrequest("POST", "/lookup")
    conn.putheader("Content-Length", str(1 << 30))
    conn.endheaders()
    resp = conn.getresponse()
    assert resp.status == 413
    conn.close()


def test_the_cli_answers_one_lookup(redis_url: str) -> None:
    tokens = list(range(7, 7 + 4 * BS))
    _publish(redis_url, make_record(), tokens, 3)
    ids = ",".join(map(str, tokens))
    out = cli("lookup", "--redis-url", redis_url, "--model", "tiny", "--token-ids", ids, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["cached_tokens"] == 3 * BS
    out = cli("lookup", "--redis-url", redis_url, "--model", "nope", "--token-ids", ids)
    assert out.returncode == 1 and "no engine has published a namespace" in out.stderr


def test_the_documented_lookup_acl_is_enough(redis_url: str) -> None:
    import re
    from pathlib import Path

    docs = (Path(__file__).resolve().parent.parent / "docs" / "operations.md").read_text()
    (line,) = re.findall(r"^ACL SETUSER lookup .*$", docs, flags=re.M)
    admin = redis.Redis.from_url(redis_url)
    admin.execute_command("ACL", "SETUSER", *line.replace("SECRET", "lk-pw").split()[2:])
    tokens = list(range(7, 7 + 4 * BS))
    _publish(redis_url, make_record(), tokens, 2)
    settings = RedisSettings.from_url(
        redis_url.replace("redis://", "redis://lookup@"), password="lk-pw"
    )
    lookup = CacheLookup(settings)
    try:
        assert lookup.lookup("tiny", token_ids=tokens).cached_tokens == 2 * BS
        # It may read, not write.
        with pytest.raises(redis.exceptions.NoPermissionError):
            lookup._redis().set(record_key("nsA"), b"x")
    finally:
        lookup.close()
        admin.execute_command("ACL", "DELUSER", "lookup")
        admin.close()
