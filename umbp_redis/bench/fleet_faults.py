"""Redis faults injected into the fleet benchmark's measured workload (``--faults``).

A schedule (``kill@20+8,pause@80+4``) names each fault's kind, its start in seconds
from the start of the measured workload (the clock of ``RequestRecord.sent_at_s``) and
its duration. Every configuration of a run gets the same schedule against its own
private Redis (``EmbeddedRedis``); without the connector the faults touch nothing the
engines use, which makes that configuration the baseline.

Kinds:

- ``kill``: SIGKILL, then a restart after the duration with an empty database (the
  server keeps nothing on disk, and a dump an earlier ``kill-keep`` left is removed);
- ``kill-keep``: ``SAVE``, SIGKILL, and a restart after the duration that loads the
  dump (same folder and file name);
- ``pause``: ``CLIENT PAUSE <ms> ALL``;
- ``sleep``: ``DEBUG SLEEP <s>``, the server's one thread busy;
- ``maxmemory``: ``maxmemory`` at ``MAXMEMORY_SHARE`` of ``used_memory`` with
  ``allkeys-lru`` for the duration, then the old settings again.

A ``FaultInjector`` runs the schedule on one thread and scrapes the engines' counters on
another (every ``POLL_S``), so that each fault can be split into phases (before, during,
after, each as long as the fault), with the requests sent in each and the connector's
counters' growth, and its "hits back": seconds from the fault's end until the engines'
loaded-blocks count grows again.
"""

from __future__ import annotations

import math
import os
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from umbp_redis.bench.fleet_workload import LatencySummary

if TYPE_CHECKING:
    from umbp_redis.bench.fleet import ConfigRun, RequestRecord
    from umbp_redis.bench.fleet_engines import RunningEngine
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

FAULT_KINDS = ("kill", "kill-keep", "pause", "sleep", "maxmemory")
FAULTS_FORM = (
    "KIND@START+DURATION[,KIND@START+DURATION...] (seconds since the measured workload "
    f"started, in order, none overlapping; KIND one of {', '.join(FAULT_KINDS)}), "
    "e.g. kill@20+8,pause@80+4"
)
MAXMEMORY_SHARE = 0.1  # the maxmemory fault's limit, a share of used_memory
POLL_S = 0.2  # how often the engines' counters are scraped
LOADED = "vllm:umbp_blocks_loaded_total"
# The connector's counters snapshotted at the phase boundaries (summed over engines).
FAULT_COUNTERS = (
    LOADED,
    "vllm:umbp_load_failures_total",
    "vllm:umbp_store_failures_total",
    "vllm:umbp_stores_dropped_total",
)
PHASES = ("before", "during", "after")


@dataclass(frozen=True)
class Fault:
    """One scheduled fault: its kind, start and duration (seconds, from the start of
    the measured workload)."""

    kind: str
    at_s: float
    duration_s: float

    @property
    def end_s(self) -> float:
        """When the fault is scheduled to end."""
        return self.at_s + self.duration_s

    @property
    def label(self) -> str:
        """``KIND@START+DURATION``, as written in ``--faults``."""
        return f"{self.kind}@{self.at_s:g}+{self.duration_s:g}"


def parse_faults(text: str) -> tuple[Fault, ...]:
    """``--faults`` text to its faults, in order; a ``ValueError`` naming ``--faults``
    and the expected form for anything else (an unknown kind, a negative start, a
    duration not above 0, faults out of order or overlapping)."""
    faults: list[Fault] = []
    for item in (s.strip() for s in text.split(",")):
        kind, at, rest = item.partition("@")
        start, plus, duration = rest.partition("+")
        try:
            fault = Fault(kind, float(start), float(duration)) if at and plus else None
        except ValueError:
            fault = None
        if fault is None or kind not in FAULT_KINDS:
            raise ValueError(f"--faults: {item!r} is not {FAULTS_FORM}")
        if not (fault.at_s >= 0 and fault.duration_s > 0 and math.isfinite(fault.end_s)):
            raise ValueError(f"--faults: {item!r} needs START >= 0 and DURATION > 0")
        if faults and fault.at_s < faults[-1].end_s:
            raise ValueError(
                f"--faults: {fault.label} starts before {faults[-1].label} ends; expected "
                f"{FAULTS_FORM}"
            )
        faults.append(fault)
    return tuple(faults)


@dataclass
class FaultRecord:
    """What one fault did: when it really started and ended (seconds since the
    workload's origin; None where the workload ended first) and what it found."""

    kind: str
    at_s: float
    duration_s: float
    started_s: float | None = None
    ended_s: float | None = None
    keys_before: int | None = None  # DBSIZE as the fault began (kill-keep: after SAVE)
    # kill, kill-keep: keys the restarted server loaded from disk; maxmemory: DBSIZE
    # when the limit was lifted.
    keys_after: int | None = None
    save_s: float | None = None  # kill-keep: the SAVE's duration
    maxmemory_bytes: int | None = None  # maxmemory: the limit set
    evicted_keys: int | None = None  # maxmemory: keys Redis evicted under it
    error: str = ""  # where applying or lifting the fault failed


@dataclass
class _Sample:
    t: float  # seconds since the origin, taken before the scrape
    counters: dict[str, float]


@dataclass
class FaultInjector:
    """Runs ``faults`` against ``server`` from ``start(origin)`` until ``stop()``, and
    scrapes ``engines()``'s counters every ``poll_s`` meanwhile.

    ``origin`` is the ``time.perf_counter()`` the workload measures its send times from.
    Faults whose start the workload does not reach are left unapplied; one in progress
    at ``stop()`` is lifted then (a killed server restarts, a limit is restored; a pause
    or sleep runs out, as Redis cannot end it early)."""

    server: EmbeddedRedis
    engines: Callable[[], Sequence[RunningEngine]]
    faults: Sequence[Fault]
    poll_s: float = POLL_S
    records: list[FaultRecord] = field(init=False)
    rss_bytes: dict[str, list[int]] = field(init=False, default_factory=dict)
    _origin: float = field(init=False, default=0.0)
    _samples: list[_Sample] = field(init=False, default_factory=list)
    _end_samples: dict[int, _Sample] = field(init=False, default_factory=dict)  # by fault
    _lock: threading.Lock = field(init=False, default_factory=threading.Lock)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _threads: list[threading.Thread] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        self.records = [FaultRecord(f.kind, f.at_s, f.duration_s) for f in self.faults]

    def now(self) -> float:
        """Seconds since the origin."""
        return time.perf_counter() - self._origin

    def start(self, origin: float) -> None:
        """Record the engines' RSS and start the schedule and the scraping, both timed
        from ``origin`` (a ``time.perf_counter()`` value)."""
        self._origin = origin
        self.rss_bytes["start"] = [engine_rss_bytes(e) for e in self.engines()]
        self._threads = [
            threading.Thread(target=self._run_schedule, name="fleet-faults", daemon=True),
            threading.Thread(target=self._poll, name="fleet-fault-poll", daemon=True),
        ]
        for t in self._threads:
            t.start()

    def wait_for_schedule(self, timeout_s: float | None = None) -> bool:
        """Block until every fault has run and been lifted (or ``stop()`` ended the
        schedule), ``timeout_s`` at most; whether it had."""
        if self._threads:
            self._threads[0].join(timeout_s)
            return not self._threads[0].is_alive()
        return False

    def stop(self) -> None:
        """Lift the fault in progress, stop the threads, take a last sample and the
        engines' RSS. Idempotent."""
        if self._stop.is_set():
            return
        self._stop.set()
        for t in self._threads:
            t.join()
        self._sample()  # the last sample, at the end of the run
        self.rss_bytes["end"] = [engine_rss_bytes(e) for e in self.engines()]

    # The schedule, on its own thread: one fault at a time, in order.

    def _run_schedule(self) -> None:
        apply = {
            "kill": self._kill,
            "kill-keep": self._kill,
            "pause": self._pause,
            "sleep": self._sleep,
            "maxmemory": self._maxmemory,
        }
        for i, (fault, rec) in enumerate(zip(self.faults, self.records, strict=True)):
            if self._stop.wait(max(0.0, fault.at_s - self.now())):
                return
            try:
                apply[fault.kind](fault, rec)
            except Exception as exc:  # the bench goes on; the record says what failed
                rec.error = repr(exc)[:300]
                if rec.started_s is not None and rec.ended_s is None:
                    rec.ended_s = self.now()
                self._ensure_running()
            end = self._sample()  # the counters right at the fault's end
            if end is not None and rec.ended_s is not None:
                self._end_samples[i] = end

    def _hold(self, fault: Fault, rec: FaultRecord) -> None:
        """Wait out the fault's duration from its start (or until ``stop()``)."""
        assert rec.started_s is not None
        self._stop.wait(max(0.0, rec.started_s + fault.duration_s - self.now()))

    def _client(self, timeout_s: float = 30.0) -> Any:
        import redis

        return redis.Redis.from_url(self.server.url, socket_timeout=timeout_s)

    def _ensure_running(self) -> None:
        if self.server.proc is None or self.server.proc.poll() is not None:
            self.server.restart()

    def _kill(self, fault: Fault, rec: FaultRecord) -> None:
        keep = fault.kind == "kill-keep"
        with self._client() as r:
            if keep:
                t = time.perf_counter()
                r.save()
                rec.save_s = time.perf_counter() - t
            rec.keys_before = int(r.dbsize())
            where = r.config_get("dir")["dir"], r.config_get("dbfilename")["dbfilename"]
        if not keep:  # an empty restart: no dump to load
            Path(*where).unlink(missing_ok=True)
        rec.started_s = self.now()
        self.server.kill()
        self._hold(fault, rec)
        self.server.restart()
        rec.ended_s = self.now()
        with self._client() as r:
            rec.keys_after = int(r.info("persistence")["rdb_last_load_keys_loaded"])

    def _pause(self, fault: Fault, rec: FaultRecord) -> None:
        with self._client(fault.duration_s + 30) as r:
            rec.keys_before = int(r.dbsize())
            rec.started_s = self.now()
            r.execute_command("CLIENT", "PAUSE", str(round(fault.duration_s * 1000)), "ALL")
            r.ping()  # answered once the pause is over
            rec.ended_s = self.now()

    def _sleep(self, fault: Fault, rec: FaultRecord) -> None:
        with self._client(fault.duration_s + 30) as r:
            rec.keys_before = int(r.dbsize())
            rec.started_s = self.now()
            r.execute_command("DEBUG", "SLEEP", f"{fault.duration_s:g}")  # returns at its end
            rec.ended_s = self.now()

    def _maxmemory(self, fault: Fault, rec: FaultRecord) -> None:
        with self._client() as r:
            old = r.config_get("maxmemory")["maxmemory"]
            policy = r.config_get("maxmemory-policy")["maxmemory-policy"]
            evicted = int(r.info("stats")["evicted_keys"])
            rec.keys_before = int(r.dbsize())
            limit = max(1, int(int(r.info("memory")["used_memory"]) * MAXMEMORY_SHARE))
            rec.maxmemory_bytes = limit
            rec.started_s = self.now()
            r.config_set("maxmemory-policy", "allkeys-lru")
            r.config_set("maxmemory", str(limit))
            self._hold(fault, rec)
            rec.keys_after = int(r.dbsize())
            rec.evicted_keys = int(r.info("stats")["evicted_keys"]) - evicted
            r.config_set("maxmemory", old)
            r.config_set("maxmemory-policy", policy)
            rec.ended_s = self.now()

    # The engines' counters, on the other thread.

    def _poll(self) -> None:
        while not self._stop.is_set():
            t = time.perf_counter()
            self._sample()
            self._stop.wait(max(0.0, self.poll_s - (time.perf_counter() - t)))

    def _sample(self) -> _Sample | None:
        """Append the engines' summed ``FAULT_COUNTERS`` now and return them (None, and
        nothing appended, where an engine does not answer its metrics)."""
        t = self.now()
        totals = dict.fromkeys(FAULT_COUNTERS, 0.0)
        try:
            for e in self.engines():
                m = e.metrics()
                for n in FAULT_COUNTERS:
                    totals[n] += m.get(n, 0.0)
        except Exception:
            return None
        sample = _Sample(t, totals)
        with self._lock:
            self._samples.append(sample)
        return sample

    def _at(self, t: float) -> dict[str, float]:
        """The counters of the sample taken nearest to ``t`` (zeros where nothing was
        sampled)."""
        with self._lock:
            samples = list(self._samples)
        if not samples:
            return dict.fromkeys(FAULT_COUNTERS, 0.0)
        return min(samples, key=lambda s: abs(s.t - t)).counters

    def hits_back_s(self, index: int) -> float | None:
        """Seconds from fault ``index``'s end until a sample shows the loaded-blocks
        count above its value at the end, looking no further than the next fault's
        start or the last sample (``stop()``'s); None where it did not grow (or the
        fault never ended)."""
        rec = self.records[index]
        if rec.ended_s is None:
            return None
        bound = math.inf
        if index + 1 < len(self.records):
            nxt = self.records[index + 1]
            bound = min(bound, nxt.started_s if nxt.started_s is not None else nxt.at_s)
        end = self._end_samples.get(index) or _Sample(rec.ended_s, self._at(rec.ended_s))
        with self._lock:
            samples = sorted(self._samples, key=lambda s: s.t)
        for s in samples:
            if s.t > bound:
                break
            if s.t > end.t and s.counters[LOADED] > end.counters[LOADED]:
                return s.t - rec.ended_s
        return None

    def report(self, requests: Sequence[RequestRecord]) -> list[dict[str, Any]]:
        """Each fault's record with its hits back and, per phase, the requests sent in
        it and the counters' growth over it (see ``phase_stats``)."""
        out = []
        for i, rec in enumerate(self.records):
            started = rec.started_s if rec.started_s is not None else rec.at_s
            ended = rec.ended_s if rec.ended_s is not None else started + rec.duration_s
            # The phases' bounds and the counters there; the sample taken right after
            # the fault's end stands for its end.
            bounds = [started - rec.duration_s, started, ended, ended + rec.duration_s]
            counters = [self._at(t) for t in bounds]
            if i in self._end_samples:
                counters[2] = self._end_samples[i].counters
            phases = {}
            for k, phase in enumerate(PHASES):
                stats = phase_stats(requests, bounds[k], bounds[k + 1])
                a, b = counters[k], counters[k + 1]
                stats["counters"] = {n: b[n] - a[n] for n in FAULT_COUNTERS}
                phases[phase] = stats
            out.append(
                {
                    **asdict(rec),
                    "label": Fault(rec.kind, rec.at_s, rec.duration_s).label,
                    "hits_back_s": self.hits_back_s(i),
                    "phases": phases,
                }
            )
        return out


def phase_stats(requests: Sequence[RequestRecord], lo: float, hi: float) -> dict[str, Any]:
    """Of the requests sent in ``[lo, hi)`` (every round): how many, completed and
    failed, TTFT mean and p90 and cached tokens per request of the completed ones, and
    the window itself."""
    sent = [q for q in requests if lo <= q.sent_at_s < hi]
    done = [q for q in sent if not q.error]
    ttft = LatencySummary.of([q.ttft_s for q in done])
    return {
        "from_s": lo,
        "to_s": hi,
        "sent": len(sent),
        "completed": len(done),
        "failed": len(sent) - len(done),
        "ttft_mean_s": ttft.mean,
        "ttft_p90_s": ttft.p90,
        "cached_tokens_per_request": (
            statistics.fmean(q.cached_tokens for q in done) if done else math.nan
        ),
    }


def engine_rss_bytes(engine: RunningEngine) -> int:
    """Resident memory of the engine's processes (its process group: the API server and
    the engine core it started), summed; 0 where /proc cannot be read."""
    return process_group_rss_bytes(engine.proc.pid)


def process_group_rss_bytes(pgid: int) -> int:
    """The summed ``VmRSS`` of every process in process group ``pgid`` (pages two of
    them share are counted twice)."""
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            if int(stat[stat.rindex(")") + 2 :].split()[2]) != pgid:
                continue
            for line in Path(f"/proc/{entry}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            continue
    return total


def fault_summary(
    faults: Sequence[Fault], runs: Sequence[ConfigRun], summary: dict[str, Any]
) -> dict[str, Any]:
    """The faults' part of the result: the schedule; per configuration and repeat the
    faults' reports, each phase's TTFT mean against no-connector's in the same phase of
    the same fault and repeat (``ttft_mean_vs_no_connector``), and the engines' RSS;
    per configuration its failed requests and ``outputs_equal_share`` (median over
    repeats) from ``summary``."""
    base = {r.repeat: r for r in runs if r.config == "no-connector"}
    out_runs = []
    for run in runs:
        reports = [dict(f) for f in run.faults]
        twin = base.get(run.repeat)
        for i, rep in enumerate(reports):
            rep["phases"] = {p: dict(s) for p, s in rep["phases"].items()}
            for phase, stats in rep["phases"].items():
                ratio = math.nan
                if twin is not None and i < len(twin.faults):
                    b = twin.faults[i]["phases"][phase]["ttft_mean_s"]
                    if b and not math.isnan(b):
                        ratio = stats["ttft_mean_s"] / b
                stats["ttft_mean_vs_no_connector"] = ratio
        out_runs.append(
            {
                "config": run.config,
                "repeat": run.repeat,
                "rss_bytes": run.engine_rss_bytes,
                "faults": reports,
            }
        )
    names = list(dict.fromkeys(r.config for r in runs))
    return {
        "schedule": [asdict(f) | {"label": f.label} for f in faults],
        "runs": out_runs,
        "failed_requests": {
            n: sum(1 for r in runs if r.config == n for q in r.requests if q.error) for n in names
        },
        "outputs_equal_share": {
            n: summary.get(n, {}).get("outputs_equal_share", {}).get("median", math.nan)
            for n in names
        },
    }


def _cell(value: Any, fmt: str) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return fmt.format(value)


def format_fault_table(faults: dict[str, Any]) -> str:
    """``fault_summary``'s result as text: one row per fault, configuration and
    repeat, with the phases' requests and TTFT and the connector's counters."""
    head = [
        "fault",
        "config",
        "rep",
        "ran s",
        "sent b/d/a",
        "failed b/d/a",
        "TTFT b/d/a",
        "d p90",
        "d vs base",
        "cached/req d",
        "load fail d/a",
        "store fail d/a",
        "dropped d/a",
        "hits back",
        "keys",
    ]
    rows = [head]
    for run in faults["runs"]:
        for f in run["faults"]:
            ph = f["phases"]

            def three(key: str, fmt: str, ph: dict[str, Any] = ph) -> str:
                return "/".join(_cell(ph[p][key], fmt) for p in PHASES)

            def two(counter: str, ph: dict[str, Any] = ph) -> str:
                return "/".join(f"{ph[p]['counters'][counter]:.0f}" for p in ("during", "after"))

            ran = "not reached"
            if f["started_s"] is not None:
                ran = f"{f['started_s']:.1f}-{_cell(f['ended_s'], '{:.1f}')}"
            keys = f"{_cell(f['keys_before'], '{}')}->{_cell(f['keys_after'], '{}')}"
            rows.append(
                [
                    f["label"],
                    run["config"],
                    str(run["repeat"]),
                    ran + (" !" if f["error"] else ""),
                    three("sent", "{}"),
                    three("failed", "{}"),
                    three("ttft_mean_s", "{:.3f}"),
                    _cell(ph["during"]["ttft_p90_s"], "{:.3f}"),
                    _cell(ph["during"]["ttft_mean_vs_no_connector"], "{:.2f}x"),
                    _cell(ph["during"]["cached_tokens_per_request"], "{:.0f}"),
                    two("vllm:umbp_load_failures_total"),
                    two("vllm:umbp_store_failures_total"),
                    two("vllm:umbp_stores_dropped_total"),
                    _cell(f["hits_back_s"], "{:.1f} s"),
                    keys,
                ]
            )
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for run in faults["runs"]:
        rss = run["rss_bytes"]
        if rss:
            mib = {k: "/".join(f"{v / 2**20:.0f}" for v in vs) for k, vs in rss.items()}
            lines.append(
                f"{run['config']} (repeat {run['repeat']}): engines' RSS MiB at the start "
                f"{mib.get('start', '-')}, at the end {mib.get('end', '-')}"
            )
    same = ", ".join(f"{n} {_cell(v, '{:.0%}')}" for n, v in faults["outputs_equal_share"].items())
    failed = ", ".join(f"{n} {v}" for n, v in faults["failed_requests"].items())
    lines.append(
        f"failed requests: {failed}; answers equal to no-connector's: {same}\n"
        "Phases b/d/a: before, during, after the fault, each as long as the fault, by send "
        "time (all rounds); 'ran s': the fault's real start and end since the workload "
        "started ('!': applying it failed, see the JSON); 'd vs base': TTFT mean during "
        "the fault over no-connector's; 'hits back': from the fault's end until the "
        "engines load blocks from Redis again; 'keys': DBSIZE as it began -> keys loaded "
        "at the restart (kill, kill-keep) or left under the limit (maxmemory)"
    )
    return "\n".join(lines)
