"""What the scheduler half keeps per request, and how it finds a block's hash."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from umbp_redis.data import BlockIdentityCodec, RequestTracker

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass(frozen=True)
class BlockHashing:
    """Where a KV block's hash is among a request's block hashes: vLLM hashes every
    ``hash_block_size`` tokens, and a KV block of ``block_size`` tokens is named by the
    hash of its last hash block."""

    block_size: int
    hash_block_size: int

    def hash_of(self, request: Request, index: int) -> bytes | None:
        """The hash of KV block ``index`` of ``request``; None past its hashed tokens."""
        pos = (index + 1) * (self.block_size // self.hash_block_size) - 1
        hashes = request.block_hashes
        return bytes(hashes[pos]) if pos < len(hashes) else None


@dataclass
class RequestState:
    """One request's lookup answers, load and store progress in the scheduler half."""

    request: Request
    tracker: RequestTracker
    local_tokens: int = 0
    # Blocks [0, known_stored_blocks) need no store from here: a lookup found them in
    # Redis, or this engine loaded them or holds them in its own prefix cache.
    known_stored_blocks: int = 0
    load_failed: bool = False  # a load of it failed on a value that would fail again
    load_async: bool = True  # how the hit of the last lookup answer loads
    sync_load_from: int = 0  # the first block its last sync load loaded
    # The request's output tokens when its last sync load was planned (None: no sync
    # load): no output since means vLLM has not confirmed that load yet.
    sync_load_outputs: int | None = None
    store_hold: int = 0  # steps its stores wait for its last sync load's outcome
    # ((local tokens, hit tokens), tokens offered) of the last load-or-compute decision.
    offer: tuple[tuple[int, int], int] | None = None
    # Encoded lookup commands of blocks [0, len(lookup_cmds)), built once per block.
    lookup_cmds: list[Any] = field(default_factory=list)
    # The codec and the plane's lookup mode the commands were built with.
    codec: BlockIdentityCodec | None = None
    lookup_mode: str = ""
    replies_per_block: int = 1  # replies of one block's commands (every group's)
    # Per cache group (in the scheduler's group order): (first reply, replies, keys)
    # within a block's replies.
    group_replies: list[tuple[int, int, int]] = field(default_factory=list)
    # Where the prompt left the prefix Redis held (full-attention groups), seen by the
    # last lookup: a hit point for groups that store only the blocks before hit points.
    divergence: int = 0
    # (block, group position) the last lookup found absent, for groups that store only
    # the blocks before hit points (they may lack blocks the engine holds locally).
    absent: set[tuple[int, int]] = field(default_factory=set)
    # With a store admission rule: blocks [0, admitted_blocks) of the prompt were asked
    # for by enough requests to be stored (None: not counted yet), and blocks
    # [0, redis_prefix_blocks) were in Redis at the last lookup.
    admitted_blocks: int | None = None
    redis_prefix_blocks: int = 0
