"""umbp-redis: a Redis-backed KV-cache object store for vLLM."""

__version__ = "0.1.0"
