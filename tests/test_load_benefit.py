"""The load-or-compute decision (``engine.load_benefit``) with scripted rates."""

from __future__ import annotations

import pytest

from umbp_redis.engine.load_benefit import (
    MIN_LOAD_SAMPLES,
    MIN_STEP_SAMPLES,
    LoadBenefit,
    RunningLinearFit,
)

MiB = 1 << 20
BPB = 2 * MiB  # bytes of one block on a worker
BS = 128  # tokens of one block


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_fit_recovers_a_line_and_falls_back_where_it_cannot() -> None:
    fit = RunningLinearFit(min_samples=3)
    fit.add(1.0, 3.0)
    fit.add(2.0, 5.0)
    assert fit.line() is None  # too few samples
    fit.add(4.0, 9.0)
    a, b = fit.line()  # type: ignore[misc]
    assert a == pytest.approx(1.0) and b == pytest.approx(2.0)
    # x that never varies: the mean seconds per unit, through the origin.
    flat = RunningLinearFit(min_samples=3)
    for _ in range(5):
        flat.add(10.0, 2.0)
    assert flat.line() == (0.0, pytest.approx(0.2))
    # y falling as x grows: nothing learned yet.
    falling = RunningLinearFit(min_samples=3)
    for x, y in ((1.0, 5.0), (2.0, 4.0), (3.0, 3.0)):
        falling.add(x, y)
    assert falling.line() is None
    # A negative intercept: the least-squares line through the origin instead.
    neg = RunningLinearFit(decay=1.0, min_samples=3)
    for x, y in ((10.0, 0.5), (20.0, 2.0), (30.0, 3.5)):
        neg.add(x, y)
    a, b = neg.line()  # type: ignore[misc]
    assert a == 0.0 and b == pytest.approx((10 * 0.5 + 20 * 2 + 30 * 3.5) / (100 + 400 + 900))
    # Bad samples are ignored.
    neg.add(0.0, 1.0)
    neg.add(1.0, -1.0)
    assert neg.samples == 3


def test_old_samples_fade() -> None:
    fit = RunningLinearFit(decay=0.5, min_samples=3)
    for x in (1.0, 2.0, 3.0) * 3:
        fit.add(x, 10 * x)  # slow
    for x in (1.0, 2.0, 3.0) * 6:
        fit.add(x, x)  # fast again
    _, b = fit.line()  # type: ignore[misc]
    assert b == pytest.approx(1.0, rel=0.01)


def learn(
    d: LoadBenefit, clock: Clock, *, load_gbps: float, rtt_s: float, tokens_per_s: float
) -> None:
    """Feed loads of 1-8 blocks and steps of 64-2048 tokens at these rates."""
    for n in range(1, 9):
        d.note_load(n * BPB, rtt_s + n * BPB / (load_gbps * 1e9))
    for tokens in (64, 256, 512, 1024, 2048, 128, 768, 1536, 4096):
        d.note_step_planned(tokens, True)
        clock.t += 0.002 + tokens / tokens_per_s  # a fixed 2 ms a step besides
        d.note_step_output()


def test_no_estimate_loads_and_a_fast_link_loads() -> None:
    clock = Clock()
    d = LoadBenefit(BPB, clock=clock)
    assert d.blocks_to_offer(20, 20 * BS) == 20  # nothing known: load and learn
    learn(d, clock, load_gbps=2.0, rtt_s=0.0005, tokens_per_s=5000)
    assert d.loads.samples >= MIN_LOAD_SAMPLES and d.steps.samples >= MIN_STEP_SAMPLES
    # 20 blocks: 40 MiB at 2 GB/s = 21 ms against 2560 tokens at 5000/s = 512 ms.
    assert d.expected_load_s(20) == pytest.approx(0.0005 + 20 * BPB / 2e9, rel=0.01)
    assert d.expected_compute_s(20 * BS) == pytest.approx(20 * BS / 5000, rel=0.01)
    assert d.blocks_to_offer(20, 20 * BS) == 20
    assert d.declined == d.tokens_declined == d.probes == 0


def test_a_slow_link_declines_and_probes_once_an_interval() -> None:
    clock = Clock()
    d = LoadBenefit(BPB, clock=clock, probe_interval_s=10.0)
    # 40 MB/s: a block in 52 ms; the engine computes a block's 128 tokens in 13 ms.
    learn(d, clock, load_gbps=0.04, rtt_s=0.001, tokens_per_s=10_000)
    assert d.blocks_to_offer(10, 10 * BS) == 0
    assert d.blocks_to_offer(3, 3 * BS) == 0
    assert (d.declined, d.tokens_declined) == (2, 13 * BS)
    # No load measured for a probe interval: one block of the next hit, once.
    clock.t += 10.5
    assert d.blocks_to_offer(10, 10 * BS) == 1 and d.probes == 1
    assert d.blocks_to_offer(10, 10 * BS) == 0
    # The link is fast again: probes teach it, and hits load again.
    offered = 0
    for _ in range(60):
        clock.t += 10.5
        offered = d.blocks_to_offer(10, 10 * BS)
        if offered == 10:
            break
        assert offered == 1
        d.note_load(BPB, 0.0005 + BPB / 2e9)
    assert offered == 10


def test_turned_off_it_offers_every_hit() -> None:
    clock = Clock()
    d = LoadBenefit(BPB, enabled=False, clock=clock)
    learn(d, clock, load_gbps=0.01, rtt_s=0.01, tokens_per_s=10_000)
    assert d.blocks_to_offer(10, 10 * BS) == 10
    assert d.declined == d.probes == 0


def test_steps_are_timed_from_their_plan_to_their_output() -> None:
    clock = Clock()
    d = LoadBenefit(BPB, clock=clock)
    for tokens in (100, 200, 400, 800, 1600, 300, 600, 1200):
        d.note_step_planned(tokens, True)
        clock.t += tokens / 1000 + 0.005
        d.note_step_output()
        clock.t += 30.0  # idle between requests: not a step's time
    assert d.expected_compute_s(1000) == pytest.approx(1.0, rel=1e-6)
    # A step with a sync load, and one with no tokens, teach nothing.
    d.note_step_planned(100, False)
    clock.t += 5.0
    d.note_step_output()
    d.note_step_planned(0, True)
    clock.t += 5.0
    d.note_step_output()
    assert d.steps.samples == 8
    # Async scheduling: the next step is planned before the last one's output.
    d.note_step_planned(1000, True)
    clock.t += 0.4
    d.note_step_planned(1000, True)
    clock.t += 0.6
    d.note_step_output()  # the first: planned 1.0 s ago
    clock.t += 1.0
    d.note_step_output()  # the second: 1.6 s ago
    assert d.steps.samples == 10
    # Outputs that never came: the pairing is dropped rather than guessed.
    for _ in range(3):
        d.note_step_planned(500, True)
    clock.t += 100.0
    d.note_step_output()
    assert d.steps.samples == 10


def test_auto_loads_a_hit_async_when_it_would_hold_the_step_up_too_long() -> None:
    from umbp_redis.engine.load_policy import LoadPolicy

    policy = LoadPolicy(
        mode="auto",
        sync_load_max_bytes=8 * MiB,
        bytes_per_block=BPB,
        sync_loads_possible=True,
        workers_load_by_layer=True,
        sync_load_timeout_s=0.5,
    )
    assert not policy.loads_async(20)  # 40 MiB by layer: sync, when nothing is known
    assert not policy.loads_async(20, expected_s=0.1)  # a fast link
    assert policy.loads_async(20, expected_s=3.0)  # a slow one: it would run out of time
    forced = LoadPolicy("auto", 8 * MiB, BPB, True, sync_load_timeout_s=0.5)
    forced.mode = False
    assert not forced.loads_async(20, expected_s=3.0)  # load_async false stays sync


def test_loads_that_ran_out_of_time_are_followed_by_one_block_not_the_whole_hit() -> None:
    clock = Clock()
    d = LoadBenefit(BPB, clock=clock)
    learn(d, clock, load_gbps=1.0, rtt_s=0.0, tokens_per_s=10_000)  # a fast link at first
    assert d.blocks_to_offer(20, 20 * BS) == 20
    # A sync load of 20 blocks ran out of its 0.5 s where 42 ms were expected: the link
    # is slower than the line says, by how much nobody knows yet.
    d.note_load(20 * BPB, 0.5, complete=False)
    assert d.expected_load_s(20) is None
    assert d.blocks_to_offer(20, 20 * BS) == 1 and d.probes == 1  # one block measures it
    assert d.blocks_to_offer(20, 20 * BS) == 1 and d.probes == 2  # until it is measured
    d.note_load(BPB, 0.1)  # 20 MB/s: 20 blocks would take 2 s, computing them 0.26 s
    assert d.blocks_to_offer(20, 20 * BS) == 0 and d.declined == 1
    # A load that ran out of time but no slower than expected changes nothing.
    d.note_load(20 * BPB, 0.5, complete=False)
    assert d.expected_load_s(20) == pytest.approx(2.0)
