"""The prefix-lookup service's HTTP front (JSON) over ``CacheLookup``.

``POST /lookup`` with ``{"model": ..., "prompt": "text"}`` or ``"token_ids": [...]``
(optional ``cache_salt``, ``lora_name`` with ``lora_path``, ``namespace``) answers
``{"model", "prompt_tokens", "cached_tokens", "namespaces": [...]}``; ``GET /models``
lists the namespaces' records; ``GET /health`` answers ``{"ok": true}``. Bad input is a
4xx with ``{"error": reason}`` (400 malformed, 404 unknown model, 409 hashes not
reproducible, 413 too large), Redis not answering a 503.
"""

from __future__ import annotations

import json
import logging
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported when used: it pulls in torch
    from umbp_redis.router.prefix_lookup import CacheLookup

log = logging.getLogger(__name__)

# Request bodies larger than this are refused (413): a 128k-token prompt as JSON token
# ids is about 1 MB.
MAX_BODY_BYTES = 16 << 20
# Seconds a connection may take to send its request (a stalled client holds one thread).
REQUEST_TIMEOUT_S = 10.0


def lora_of(name: Any, path: Any) -> tuple[str, str] | None:
    """A request's LoRA as (name, path), None without one; raises ``BadLookupRequest``
    unless both are strings or both are absent."""
    from umbp_redis.router.prefix_lookup import BadLookupRequest

    if name is None and path is None:
        return None
    if not isinstance(name, str) or not isinstance(path, str):
        raise BadLookupRequest("a LoRA needs both 'lora_name' and 'lora_path' (strings)")
    return name, path


def answer_request(lookup: CacheLookup, body: Any) -> dict[str, Any]:
    """The answer to one ``POST /lookup`` body (parsed JSON); raises ``LookupFailed``."""
    from umbp_redis.router.prefix_lookup import BadLookupRequest

    if not isinstance(body, dict):
        raise BadLookupRequest("the body must be a JSON object")
    unknown = set(body) - {
        "model",
        "prompt",
        "token_ids",
        "cache_salt",
        "lora_name",
        "lora_path",
        "namespace",
    }
    if unknown:
        raise BadLookupRequest(f"unknown fields {sorted(unknown)}")
    namespace = body.get("namespace")
    if namespace is not None and not isinstance(namespace, str):
        raise BadLookupRequest("'namespace' must be a string")
    return lookup.lookup(
        body.get("model"),  # type: ignore[arg-type]
        text=body.get("prompt"),
        token_ids=body.get("token_ids"),
        cache_salt=body.get("cache_salt"),
        lora=lora_of(body.get("lora_name"), body.get("lora_path")),
        namespace=namespace,
    ).to_dict()


def make_server(lookup: CacheLookup, host: str, port: int) -> ThreadingHTTPServer:
    """An HTTP server answering lookups with ``lookup`` (not started: ``serve_forever``)."""
    from umbp_redis.router.prefix_lookup import LookupFailed

    class Handler(BaseHTTPRequestHandler):
        timeout = REQUEST_TIMEOUT_S
        protocol_version = "HTTP/1.1"

        def _send(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            if self.path == "/health":
                self._send(200, {"ok": True})
            elif self.path == "/models":
                try:
                    records = lookup.records()
                except LookupFailed as e:
                    self._send(e.status, {"error": str(e)})
                    return
                self._send(200, {"models": [json.loads(r.to_json()) for r in records.values()]})
            else:
                self._send(404, {"error": f"no such path {self.path!r}: POST /lookup"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/lookup":
                self._send(404, {"error": f"no such path {self.path!r}: POST /lookup"})
                return
            try:
                length = int(self.headers.get("Content-Length", ""))
            except ValueError:
                self._send(411, {"error": "a Content-Length header is needed"})
                return
            if length < 0 or length > MAX_BODY_BYTES:
                self.close_connection = True
                self._send(413, {"error": f"a body of {length} bytes is over {MAX_BODY_BYTES}"})
                return
            try:
                body = json.loads(self.rfile.read(length) or b"null")
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                self._send(400, {"error": f"the body is not JSON: {e}"})
                return
            try:
                self._send(200, answer_request(lookup, body))
            except LookupFailed as e:
                self._send(e.status, {"error": str(e)})
            except Exception as e:  # a bug: said as such, the server keeps serving
                log.exception("umbp-redis serve-lookup: internal error")
                self._send(500, {"error": f"internal error: {e!r}"})

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            log.debug("serve-lookup: " + format, *args)

    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    return server
