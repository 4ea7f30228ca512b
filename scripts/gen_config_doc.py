"""Regenerate docs/configuration.md from the option table in umbp_redis/store/settings.py."""

from __future__ import annotations

from pathlib import Path

from umbp_redis.store.settings import OPTIONS, _type_name

HEAD = """# Configuration

Every option goes in `kv_connector_extra_config` of `--kv-transfer-config`, for example

```
--kv-transfer-config '{"kv_connector":"UMBPRedisConnector","kv_role":"kv_both",
  "kv_load_failure_policy":"recompute",
  "kv_connector_extra_config":{"redis_url":"redis://redis:6379/0","ttl_seconds":86400}}'
```

(`kv_connector_module_path` is not needed once the package is installed: it registers the
name through the `vllm.general_plugins` entry point.) Unknown keys and wrong types are
errors at startup that name the key and list the valid ones (`umbp_redis/store/settings.py` holds
the table this page is generated from by `scripts/gen_config_doc.py` and checked against by
`tests/test_docs.py`).

`kv_role`: `kv_both` loads and stores, `kv_consumer` never stores, `kv_producer` never
loads. `kv_load_failure_policy` must be `recompute` so that a block evicted or damaged
between lookup and load is recomputed instead of failing the request; vLLM's default is
`fail`, so the connector sets `recompute` at startup and logs a warning when it had to.

**Secrets:** vLLM prints `kv_connector_extra_config` verbatim in its startup log, so a
password in `redis_url` or `password` is logged there. Use `password_file` or the
environment variable `UMBP_REDIS_PASSWORD` (see [operations](operations.md#keep-the-password-out-of-logs)).

| option | type | default | meaning |
|---|---|---|---|
"""

TAIL = """
## Environment

| variable | meaning |
|---|---|
| `UMBP_REDIS_URL` | server URL when `redis_url` is not given (also read by the `umbp-redis` CLI) |
| `UMBP_REDIS_PASSWORD` | password when neither the URL nor `password` gives one |
| `UMBP_REDIS_SERVER` | path of the `redis-server` binary the tests and the demo start |

## Tuning notes

- `max_inflight_bytes` bounds the replies one connection has asked for but not read. Redis
  buffers them in its client output buffer, which counts toward `maxmemory` and can get the
  client disconnected by `client-output-buffer-limit`; small windows were also measured to be
  faster here (the server's reply buffers stay warm). Half of it is sent before the
  previous half is read, and every send holds at least one object, so objects of half
  the window or more move one at a time, two in flight. 1 MiB (the default since
  2026-12-04) against 4 MiB: 64 KiB store/load 1.97/2.92 against 1.10/1.56 GB/s, 512 KiB
  4.46/5.25 against 3.46/3.04 (`benchmarks/small_objects_bench.py`); the same for 2 MiB
  objects (one a send either way).
- `transfer_connections` spreads one batch over connections. `auto` takes 1 below 4 CPUs:
  on this project's 2-core machine an engine loading by layer on one connection loaded
  at 1.36-1.38 GB/s against 1.08-1.27 on two, and its forward passes waited 2.8-2.9
  against 4.7-5.3 ms a load for their layers (`benchmarks/warm_ttft_bench.py --compare
  two-connections`, [performance](performance.md)); machines of 4 CPUs or more keep 2.
- `lookup_timeout_s` bounds the scheduler's wait per request: past it the blocks are misses.
  `lookup_async` takes even that wait off the scheduler thread.
- `fail_fast_s`: after a connection failure every call fails at once for this long, so a dead
  server costs no timeouts per step; then the next call reconnects.
- `max_staging_bytes` bounds host memory per worker; size it to at least a step's stores
  (blocks per step x object size). Dropped stores are counted in the `stores_dropped` stat.
  It must hold at least one object (workers log `group N object S bytes` at startup); less
  fails startup with an error that names the option and the object size.
"""


def _default(o) -> str:  # type: ignore[no-untyped-def]
    if o.default is None:
        return "unset"
    if isinstance(o.default, str):
        return f'"{o.default}"'
    if isinstance(o.default, int) and not isinstance(o.default, bool) and o.default >= 1 << 20:
        return f"{o.default} ({o.default >> 20} MiB)"
    return repr(o.default)


# Links to other pages, added to an option's description on this page only.
DOC_LINKS = {"store_mode": " See [Store modes](operations.md#store-modes)."}

OUT = Path(__file__).resolve().parent.parent / "docs" / "configuration.md"


def render() -> str:
    """The text of docs/configuration.md for the current option table."""
    rows = [
        f"| `{o.name}` | {_type_name(o.type)} | {_default(o)} | "
        f"{o.doc}{DOC_LINKS.get(o.name, '')} |"
        for o in OPTIONS
    ]
    return HEAD + "\n".join(rows) + "\n" + TAIL


def main() -> None:
    OUT.write_text(render())


if __name__ == "__main__":
    main()
