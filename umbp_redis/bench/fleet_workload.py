"""The fleet benchmark's workload, routers and summaries: plain logic, no I/O.

A workload is a set of multi-turn conversations written as token ids, so every
configuration of a run sends exactly the same prompts whatever the model answers:
each conversation opens with one system prompt shared by all of them, and each round
appends a new user turn; the assistant turns in the history are scripted, not the
model's answer. A router picks the engine of each (conversation, round).
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# Token ids the workloads draw from: above the tiny tokenizer's special tokens.
FIRST_TOKEN_ID = 3


def _require_at_least(shape: object, minimum: int, *names: str) -> None:
    """Raise ``ValueError`` naming the first of ``names`` whose value on ``shape`` is
    below ``minimum``."""
    for name in names:
        if getattr(shape, name) < minimum:
            raise ValueError(f"{name} must be at least {minimum}, got {getattr(shape, name)}")


@dataclass(frozen=True)
class ConversationShape:
    """How long each part of a conversation is, in tokens."""

    conversations: int = 4
    rounds: int = 6
    system_tokens: int = 640
    user_tokens: int = 96
    assistant_tokens: int = 160
    answer_tokens: int = 16  # tokens each request generates (streamed)
    vocab_size: int = 512
    seed: int = 7

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        _require_at_least(self, 1, "conversations", "rounds", "user_tokens", "answer_tokens")
        _require_at_least(self, 0, "system_tokens", "assistant_tokens")
        if self.vocab_size <= FIRST_TOKEN_ID + 1:
            raise ValueError(f"vocab_size must exceed {FIRST_TOKEN_ID + 1}, got {self.vocab_size}")

    @property
    def longest_request_tokens(self) -> int:
        """Tokens of the longest request: the last round's prompt and its answer."""
        return self.prompt_tokens(self.rounds - 1) + self.answer_tokens

    def prompt_tokens(self, round_index: int) -> int:
        """Prompt length of round ``round_index`` (0-based) of any conversation."""
        return (
            self.system_tokens
            + (round_index + 1) * self.user_tokens
            + round_index * self.assistant_tokens
        )


@dataclass(frozen=True)
class RepetitionShape:
    """vLLM's ``prefix_repetition`` dataset as the fleet benchmark sends it: ``prompts``
    prompts, each one of ``prefixes`` shared prefixes plus its own suffix, in tokens."""

    prompts: int = 16
    prefixes: int = 4
    prefix_tokens: int = 1024
    suffix_tokens: int = 128
    answer_tokens: int = 16
    concurrency: int = 4  # requests in flight at most
    seed: int = 7

    # Tokens a prompt may gain when vLLM's client decodes and re-encodes it.
    RETOKENIZE_SLACK = 16

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first field out of range."""
        _require_at_least(
            self,
            1,
            "prompts",
            "prefixes",
            "prefix_tokens",
            "suffix_tokens",
            "answer_tokens",
            "concurrency",
        )
        if self.prompts < self.prefixes:
            raise ValueError(
                f"prompts ({self.prompts}) must be at least prefixes ({self.prefixes})"
            )

    @property
    def longest_request_tokens(self) -> int:
        """Tokens of the longest request, prompt and answer, with room for re-tokenizing."""
        return self.prefix_tokens + self.suffix_tokens + self.answer_tokens + self.RETOKENIZE_SLACK


@dataclass(frozen=True)
class Turn:
    """One request: the prompt of round ``round_index`` of conversation ``conversation``."""

    conversation: int
    round_index: int
    prompt: tuple[int, ...]


class ConversationScript:
    """Every prompt of a workload, deterministic for its shape (``shape.seed``)."""

    def __init__(self, shape: ConversationShape) -> None:
        shape.validate()
        self.shape = shape
        rng = random.Random(shape.seed)

        def tokens(n: int) -> list[int]:
            return [rng.randrange(FIRST_TOKEN_ID, shape.vocab_size) for _ in range(n)]

        system = tokens(shape.system_tokens)
        self._prompts: list[list[tuple[int, ...]]] = []
        for _ in range(shape.conversations):
            history = list(system)
            rounds = []
            for r in range(shape.rounds):
                if r:
                    history += tokens(shape.assistant_tokens)
                history += tokens(shape.user_tokens)
                rounds.append(tuple(history))
            self._prompts.append(rounds)

    def turn(self, conversation: int, round_index: int) -> Turn:
        """The request of round ``round_index`` of ``conversation``."""
        return Turn(conversation, round_index, self._prompts[conversation][round_index])


ROUTERS = ("round-robin", "random", "sticky", "least-loaded")
# The vLLM project's router (``vllm-router``), run as a process in front of the engines:
# a routing ``vllm-router:POLICY`` names one of its policies.
VLLM_ROUTER = "vllm-router"
VLLM_ROUTER_POLICIES = ("kv_aware", "round_robin", "cache_aware")
ROUTINGS = (*ROUTERS, *(f"{VLLM_ROUTER}:{p}" for p in VLLM_ROUTER_POLICIES))


def vllm_router_policy(routing: str) -> str | None:
    """The vllm-router policy of a routing (``vllm-router:kv_aware``: ``kv_aware``);
    None for this package's own routers; ``ValueError`` for anything else."""
    if routing in ROUTERS:
        return None
    head, sep, policy = routing.partition(":")
    if head == VLLM_ROUTER and sep and policy in VLLM_ROUTER_POLICIES:
        return policy
    raise ValueError(f"routing must be one of {', '.join(ROUTINGS)}, got {routing!r}")


def routed_away_share(served: Iterable[tuple[int, int, int]]) -> float:
    """Of ``(conversation, round, engine)`` requests, the share of rounds after the
    first (0-based round >= 1) served by another engine than the conversation's
    previous round; requests whose engine, or whose previous round's, is unknown
    (negative) are left out; NaN when none is left."""
    engine_of = {(c, r): e for c, r, e in served}
    moved = counted = 0
    for (c, r), e in engine_of.items():
        prev = engine_of.get((c, r - 1), -1)
        if r < 1 or e < 0 or prev < 0:
            continue
        counted += 1
        moved += e != prev
    return moved / counted if counted else math.nan


@dataclass(frozen=True)
class Router:
    """Picks the engine of each request.

    ``round-robin``: round r of conversation c goes to engine (c + r) mod N, so every
    new turn lands on another engine than the last; ``sticky``: conversation c always
    on engine c mod N; ``random``: a seeded choice per (conversation, round), the same
    in every configuration of a run; ``least-loaded``: the engine with the fewest
    requests in flight, ties broken as round-robin would, so engines stay evenly loaded
    while turns still move between them.
    """

    policy: str
    engines: int
    seed: int = 11

    def __post_init__(self) -> None:
        if self.policy not in ROUTERS:
            raise ValueError(f"router must be one of {', '.join(ROUTERS)}, got {self.policy!r}")
        if self.engines < 1:
            raise ValueError(f"engines must be at least 1, got {self.engines}")

    def engine_for(self, conversation: int, round_index: int, in_flight: Sequence[int] = ()) -> int:
        """Index of the engine that serves this request; ``in_flight`` (requests now
        running on each engine) is read by ``least-loaded`` only."""
        if self.policy == "sticky":
            return conversation % self.engines
        turn = (conversation + round_index) % self.engines
        if self.policy == "round-robin":
            return turn
        if self.policy == "least-loaded":
            if len(in_flight) != self.engines:
                raise ValueError("least-loaded routing needs the in-flight count of every engine")
            fewest = min(in_flight)
            # The first engine with the fewest, counting from round-robin's pick.
            return next(
                e
                for e in ((turn + i) % self.engines for i in range(self.engines))
                if in_flight[e] == fewest
            )
        return random.Random(f"{self.seed}:{conversation}:{round_index}").randrange(self.engines)


@dataclass(frozen=True)
class LatencySummary:
    """Mean and percentiles of a set of latencies, in seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p99: float

    @classmethod
    def of(cls, values: Sequence[float]) -> LatencySummary:
        """Summary of ``values`` (all NaN when empty); percentiles by linear interpolation."""
        if not values:
            nan = math.nan
            return cls(0, nan, nan, nan, nan)
        return cls(
            len(values),
            statistics.fmean(values),
            percentile(values, 50),
            percentile(values, 90),
            percentile(values, 99),
        )


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of non-empty ``values``, linearly interpolated."""
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def share_of_ideal_gain(baseline: float, measured: float, ideal: float) -> float:
    """(baseline - measured) / (baseline - ideal): 1.0 when ``measured`` reaches the
    ideal, 0.0 when it is no better than the baseline; NaN when the ideal gains nothing."""
    gain = baseline - ideal
    if not gain > 0:
        return math.nan
    return (baseline - measured) / gain
