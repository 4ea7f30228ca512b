"""Whether a hit is worth loading: its expected load time against recomputing it.

The scheduler learns two costs from this engine's own work, each a running
least-squares line over recent samples (``RunningLinearFit``):

- a load: seconds against bytes per worker, from the workers' load times (the line's
  intercept is the round trips and fixed work, its slope the inverse bandwidth);
- a step: seconds against the tokens it computed, from the time between the
  scheduler planning it and its output coming back (the slope is what one more prompt
  token costs to compute).

A hit of H tokens is offered when its load is expected to take no longer than
computing those H tokens would (``LoadBenefit.blocks_to_offer``); both costs grow
linearly with H and the load has the larger intercept, so the answer is the whole hit
or none of it. Until both lines are known every hit loads (and is measured). While
hits are declined, one block of a hit is loaded at most every ``PROBE_INTERVAL_S`` so
that a link that became fast again is noticed (a load ``FASTER_LINK_FACTOR`` times
faster than expected starts the load line anew).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)

# Weight kept by a sample per newer one: about 1 / (1 - DECAY) samples of memory.
DECAY = 0.95
# Samples each line needs before it is used.
MIN_LOAD_SAMPLES = 1
MIN_STEP_SAMPLES = 3
# While hits are declined, one block is loaded at most this often to measure the link.
PROBE_INTERVAL_S = 30.0
# A load this many times faster than expected means the link changed: relearn it.
FASTER_LINK_FACTOR = 4.0
# Steps planned and not yet reported at most (vLLM's async scheduling plans one ahead).
MAX_PENDING_STEPS = 2
# Below this spread of x (relative to its mean) the slope is not trusted and the line
# goes through the origin (the mean seconds per unit).
MIN_RELATIVE_SPREAD = 0.2


class RunningLinearFit:
    """A least-squares line ``y = a + b x`` over recent samples; each new sample
    weighs every older one down by ``decay``. Constant time and memory per sample."""

    def __init__(self, decay: float = DECAY, min_samples: int = 3) -> None:
        self.decay = decay
        self.min_samples = min_samples
        self.samples = 0
        self._w = self._x = self._y = self._xx = self._xy = 0.0

    def add(self, x: float, y: float) -> None:
        """One sample (``x`` > 0 and ``y`` >= 0; others are ignored)."""
        if not (x > 0 and y >= 0):
            return
        d = self.decay
        self._w = self._w * d + 1.0
        self._x = self._x * d + x
        self._y = self._y * d + y
        self._xx = self._xx * d + x * x
        self._xy = self._xy * d + x * y
        self.samples += 1

    def line(self) -> tuple[float, float] | None:
        """(intercept >= 0, slope >= 0) of the fit; None before ``min_samples`` or
        where y falls as x grows (noise, nothing to learn from yet). Where x hardly
        varies, or the intercept would be negative, the line goes through the origin."""
        if self.samples < self.min_samples or self._x <= 0:
            return None
        mean_x, mean_y = self._x / self._w, self._y / self._w
        var_x = self._xx / self._w - mean_x * mean_x
        if var_x <= (MIN_RELATIVE_SPREAD * mean_x) ** 2:
            return 0.0, self._y / self._x
        slope = (self._xy / self._w - mean_x * mean_y) / var_x
        if slope <= 0:
            return None
        intercept = mean_y - slope * mean_x
        if intercept < 0:
            return 0.0, self._xy / self._xx
        return intercept, slope


class LoadBenefit:
    """Decides how many blocks of a hit to offer, from the engine's own load and step
    times; counts what it declined.

    ``bytes_per_block``: one block's bytes on each worker (every layer and group);
    ``enabled`` False offers every hit (and still learns, for the stats)."""

    def __init__(
        self,
        bytes_per_block: int,
        *,
        enabled: bool = True,
        clock: Callable[[], float] = time.monotonic,
        probe_interval_s: float = PROBE_INTERVAL_S,
    ) -> None:
        self.bytes_per_block = bytes_per_block
        self.enabled = enabled
        self.clock = clock
        self.probe_interval_s = probe_interval_s
        self.loads = RunningLinearFit(min_samples=MIN_LOAD_SAMPLES)  # bytes -> seconds
        self.steps = RunningLinearFit(min_samples=MIN_STEP_SAMPLES)  # tokens -> seconds
        self.declined = 0  # hits not offered (requests)
        self.tokens_declined = 0
        self.probes = 0  # hits of which one block was offered to measure the link
        self._last_load_at: float | None = None
        self._timed_out = False  # a load ran out of time since the line's last sample
        self._declining = False
        # Steps planned whose output has not come back: (when planned, tokens, whether
        # their time measures computing them).
        self._pending_steps: deque[tuple[float, int, bool]] = deque()

    # -- learning -----------------------------------------------------------------

    def note_load(self, nbytes: int, seconds: float, complete: bool = True) -> None:
        """A worker's load of ``nbytes`` took ``seconds``; ``complete`` False: it ran out
        of time after ``seconds`` (a sync load's deadline), so it says only that the
        link is at least that slow. Such a load slower than the line expects, or a load
        many times faster than it expects (a link that became fast again, seen by a
        probe), starts the line anew: its old samples no longer describe the link.
        Until a complete load is measured again, hits are probed (``blocks_to_offer``)."""
        expected = self.expected_load_s(nbytes / self.bytes_per_block)
        self._last_load_at = self.clock()
        if not complete:
            if expected is None or seconds > expected:
                self.loads = RunningLinearFit(min_samples=MIN_LOAD_SAMPLES)
                self._timed_out = True
            return
        if expected is not None and seconds * FASTER_LINK_FACTOR < expected:
            self.loads = RunningLinearFit(min_samples=MIN_LOAD_SAMPLES)
        self.loads.add(nbytes, seconds)
        self._timed_out = False

    def note_step_planned(self, tokens: int, clean: bool) -> None:
        """The scheduler planned a step that computes ``tokens``; ``clean`` False when
        its time would not measure computing (a sync load in it). Its time runs from now
        to its output (``note_step_output``)."""
        self._pending_steps.append((self.clock(), tokens, clean))
        if len(self._pending_steps) > MAX_PENDING_STEPS:
            # More steps planned than outputs seen: the pairing is lost; start again.
            self._pending_steps.clear()

    def note_step_output(self) -> None:
        """The output of the oldest step planned and not yet reported has come back: its
        time is a sample of what its tokens cost to compute."""
        if not self._pending_steps:
            return
        planned_at, tokens, clean = self._pending_steps.popleft()
        if clean and tokens > 0:
            self.steps.add(tokens, self.clock() - planned_at)

    # -- deciding -----------------------------------------------------------------

    def expected_load_s(self, blocks: float) -> float | None:
        """Seconds a load of ``blocks`` blocks is expected to take; None: unknown."""
        line = self.loads.line()
        if line is None:
            return None
        return line[0] + line[1] * blocks * self.bytes_per_block

    def expected_compute_s(self, tokens: int) -> float | None:
        """Seconds computing ``tokens`` more prompt tokens is expected to add to the
        engine's steps; None: unknown."""
        line = self.steps.line()
        return None if line is None else line[1] * tokens

    def blocks_to_offer(self, blocks: int, tokens: int) -> int:
        """How many of a hit's ``blocks`` (``tokens`` tokens) to offer: all of them
        when their load is expected to finish before their computation would, or
        either estimate is unknown; else none, or one block as a probe of the link.
        After a load ran out of time with no line to go by, one block too: the link is
        measured at the cost of one block rather than of a whole hit. An offer of
        fewer blocks than the hit is a probe, to be loaded async (no deadline cuts it
        short)."""
        if blocks <= 0:
            return 0
        load_s = self.expected_load_s(blocks)
        compute_s = self.expected_compute_s(tokens)
        if load_s is None and self._timed_out and self.enabled and blocks > 1:
            self.probes += 1
            return 1
        if load_s is None or compute_s is None or load_s <= compute_s:
            if self._declining:
                self._declining = False
                log.info("umbp-redis: hits load again (expected load no slower than computing)")
            return blocks
        if not self.enabled:
            return blocks
        if not self._declining:
            self._declining = True
            log.warning(
                "umbp-redis: a hit of %d tokens is expected to load in %.1f ms and compute in "
                "%.1f ms: hits that load slower than they compute are recomputed "
                "(decline_slow_loads)",
                tokens,
                load_s * 1e3,
                compute_s * 1e3,
            )
        now = self.clock()
        if self._last_load_at is None or now - self._last_load_at >= self.probe_interval_s:
            self._last_load_at = now  # one probe an interval, whenever its sample comes
            self.probes += 1
            return 1
        self.declined += 1
        self.tokens_declined += tokens
        return 0
