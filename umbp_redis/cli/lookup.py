"""``umbp-redis lookup`` (one prompt) and ``umbp-redis serve-lookup`` (the HTTP service
of ``umbp_redis.router.http_service``) over ``umbp_redis.router.prefix_lookup.CacheLookup``.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from umbp_redis.router.http_service import lora_of, make_server
from umbp_redis.store.settings import RedisSettings

if TYPE_CHECKING:  # imported when used: it pulls in torch, which the CLI's help need not
    from umbp_redis.router.prefix_lookup import LookupAnswer


def register(sub: Any) -> None:
    """Add ``lookup`` and ``serve-lookup`` to the CLI."""
    from umbp_redis.cli.admin import add_server_args as common

    p = sub.add_parser(
        "lookup", help="how many prefix tokens of a prompt the shared cache holds for a model"
    )
    common(p)
    p.add_argument("--model", required=True, help="the model name the engines serve")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--prompt", help="prompt text (tokenized with the model's tokenizer)")
    what.add_argument("--token-ids", help="prompt token ids, comma-separated")
    p.add_argument("--cache-salt", default=None, help="the requests' cache_salt")
    p.add_argument("--lora-name", default=None, help="LoRA adapter name (with --lora-path)")
    p.add_argument("--lora-path", default=None, help="LoRA adapter path as the engines load it")
    p.add_argument("--namespace", default=None, help="only this namespace")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(handler=cmd_lookup)

    p = sub.add_parser("serve-lookup", help="serve prefix lookups over HTTP (JSON)")
    common(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=int, default=8765, help="port to listen on")
    p.set_defaults(handler=cmd_serve_lookup)


def _settings(args: argparse.Namespace) -> RedisSettings:
    return RedisSettings.from_options({"redis_url": args.redis_url, "cluster": args.cluster})


def cmd_lookup(args: argparse.Namespace) -> int:
    """One lookup, printed; exit code 0, or 1 with the reason."""
    from umbp_redis.router.prefix_lookup import BadLookupRequest, CacheLookup, LookupFailed

    lookup = CacheLookup(_settings(args))
    try:
        token_ids = None
        if args.token_ids is not None:
            try:
                token_ids = [int(t) for t in args.token_ids.split(",") if t.strip()]
            except ValueError:
                raise BadLookupRequest("--token-ids must be comma-separated integers") from None
        answer = lookup.lookup(
            args.model,
            text=args.prompt,
            token_ids=token_ids,
            cache_salt=args.cache_salt,
            lora=lora_of(args.lora_name, args.lora_path),
            namespace=args.namespace,
        )
    except LookupFailed as e:
        print(f"umbp-redis lookup: {e}", file=sys.stderr)
        return 1
    finally:
        lookup.close()
    if args.json:
        print(json.dumps(answer.to_dict()))
    else:
        _print_answer(answer)
    return 0


def _print_answer(answer: LookupAnswer) -> None:
    print(f"model          {answer.model}")
    print(f"prompt tokens  {answer.prompt_tokens}")
    print(f"cached tokens  {answer.cached_tokens}")
    for ns in answer.namespaces:
        print(f"  namespace {ns.namespace}: {ns.cached_tokens} tokens ({ns.cached_blocks} blocks)")


def cmd_serve_lookup(args: argparse.Namespace) -> int:
    """Serve until interrupted."""
    from umbp_redis.router.prefix_lookup import CacheLookup

    lookup = CacheLookup(_settings(args))
    server = make_server(lookup, args.host, args.port)
    print(f"umbp-redis: serving prefix lookups on http://{args.host}:{args.port}/lookup")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
        lookup.close()
    return 0
