"""The vLLM project's Rust router (``vllm-router``, the ``router`` extra) as a process in
front of OpenAI-server engines: start it with the engines' URLs and KV event sources,
wait until it serves, stop it, and say which engine served each request.

``start_vllm_router`` starts the binary in a process group of its own, its output in a
log file, with ``--worker-urls`` and, for the ``kv_aware`` policy (the others refuse
event sources), per engine that publishes KV events ``--kv-event-source
URL=tcp://127.0.0.1:PORT`` (and ``--kv-event-replay-source``);
``--kv-event-block-size`` and ``--kv-event-model`` are the engines' block size and model.
The engines must publish on the matching ports (``kv_events_config``: a ZMQ publisher
bound to ``tcp://*:PORT`` with an empty topic; the router drops frames of any other
topic) with ``--block-size`` equal to the router's (events of another block size are
ignored). Extra flags (``--kv-penalty-external``, ``--router-temperature``,
``--kv-aware-session-affinity-ttl-secs``...) pass through unchanged.

Which engine served a request. vllm-router 0.1.17 adds no header naming the worker to
its responses, and its decision log (``KV prefix decision ... worker=...``, at debug
level) names the worker but not the request, so under concurrent traffic it cannot be
joined to requests. It does forward the client's ``x-request-id`` header to the worker,
and vLLM takes it as its request id (``cmpl-<id>-<n>`` for a completion); an engine run
with ``--enable-log-requests`` logs ``Received request cmpl-<id>-0`` when the request
reaches it. ``served_by`` reads those lines back from each engine's log: an exact,
per-engine record that needs no clock and no timing guess. A request found in no log
(or in several, had the router retried it on a second engine after the first had
accepted it) is reported as served by no known engine.

Workers that join later. 0.1.17 has ``POST /add_worker?url=...``, but a worker added
that way gets no KV index: a static ``--kv-event-source`` must name a ``--worker-urls``
entry at start, and discovery asks the worker for ``/get_server_info``, which vLLM 0.32
does not serve (404: "cannot index"). So an engine that starts later is listed from the
start, with its event source: until it answers, the router's attempts to reach it fail
to connect and are retried on another worker (a few tens of milliseconds), the health
checker (``--health-check-interval-secs``, 1 s here) marks it unhealthy, then healthy
once it answers, and its ZMQ subscriber connects by itself when the engine binds.
``RunningRouter.worker_routable`` says when the router will send it requests again.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from umbp_redis.bench.fleet_engines import log_tail, parse_prometheus
from umbp_redis.bench.fleet_workload import VLLM_ROUTER, VLLM_ROUTER_POLICIES
from umbp_redis.testing.embedded_redis import free_port

BINARY = VLLM_ROUTER
INSTALL_HINT = "pip install 'umbp-redis[router]'"
# The policies the fleet benchmark offers (the binary has more).
POLICIES = VLLM_ROUTER_POLICIES
# vLLM's log line for a request reaching the OpenAI server (``--enable-log-requests``).
_RECEIVED = re.compile(r"Received request (?:cmpl|chatcmpl)-(\S+?)-\d+: ")
_SAMPLE_LABEL = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)\{worker="([^"]*)"\}\s+(\S+)\s*$')


class RouterMissingError(RuntimeError):
    """The ``vllm-router`` binary is not installed."""


class RouterStartError(RuntimeError):
    """The router exited or did not serve in time; carries its log's tail."""


@dataclass(frozen=True)
class RouterWorker:
    """One engine as the router sees it: its base URL and, where it publishes KV
    events, the ZMQ endpoints the router connects to (``tcp://HOST:PORT``)."""

    base_url: str
    events_endpoint: str | None = None
    replay_endpoint: str | None = None


def find_router_binary() -> str:
    """Path of ``vllm-router``: on ``PATH``, else beside ``sys.executable`` (a virtual
    environment not activated); raises ``RouterMissingError`` naming the extra."""
    found = shutil.which(BINARY)
    if found:
        return found
    beside = Path(sys.executable).parent / BINARY
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    raise RouterMissingError(
        f"{BINARY} is not installed (not on PATH nor beside {sys.executable}): {INSTALL_HINT}"
    )


def kv_events_config(events_port: int, replay_port: int | None = None) -> dict[str, object]:
    """vLLM's ``--kv-events-config`` for an engine the router reads: a ZMQ publisher
    bound on ``events_port`` (and a replay socket on ``replay_port``), empty topic."""
    cfg: dict[str, object] = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://*:{events_port}",
    }
    if replay_port is not None:
        cfg["replay_endpoint"] = f"tcp://*:{replay_port}"
    return cfg


def router_command(
    binary: str,
    workers: Sequence[RouterWorker],
    policy: str,
    block_size: int,
    model_name: str,
    port: int,
    prometheus_port: int,
    extra_args: Sequence[str] = (),
    *,
    health_check_interval_s: int = 1,
) -> list[str]:
    """The router's command line: every worker, then for the ``kv_aware`` policy (the
    only one that reads KV events; the router refuses event sources for the others)
    the event sources of the workers that publish, block size and model identity, and
    last ``extra_args`` (which may override the health-check interval given before)."""
    if not workers:
        raise ValueError("the router needs one worker at least")
    cmd = [
        binary,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prometheus-port",
        str(prometheus_port),
        "--policy",
        policy,
        "--health-check-interval-secs",
        str(health_check_interval_s),
        "--worker-urls",
        *(w.base_url for w in workers),
    ]
    if policy == "kv_aware" and any(w.events_endpoint for w in workers):
        cmd += ["--kv-event-block-size", str(block_size), "--kv-event-model", model_name]
        for w in workers:
            if w.events_endpoint:
                cmd += ["--kv-event-source", f"{w.base_url}={w.events_endpoint}"]
            if w.events_endpoint and w.replay_endpoint:
                cmd += ["--kv-event-replay-source", f"{w.base_url}={w.replay_endpoint}"]
    return cmd + list(extra_args)


@dataclass
class RunningRouter:
    """A started router: where it serves, its Prometheus port and its log."""

    proc: subprocess.Popen[bytes]
    port: int
    prometheus_port: int
    log_path: Path
    workers: tuple[RouterWorker, ...]

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``, where clients send their requests."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the router's log."""
        return log_tail(self.log_path, chars)

    def serving(self) -> bool:
        """Whether the router answers ``/list_workers`` with every worker (raises
        ``RouterStartError`` if it exited)."""
        if self.proc.poll() is not None:
            raise RouterStartError(
                f"{BINARY} exited with {self.proc.returncode}:\n{self.log_tail()}"
            )
        try:
            with urllib.request.urlopen(self.base_url + "/list_workers", timeout=2) as resp:
                listed = resp.read().decode()
        except (urllib.error.URLError, OSError):
            return False
        return all(w.base_url in listed for w in self.workers)

    def worker_states(self) -> dict[str, dict[str, float]]:
        """Per worker URL, the router's ``vllm_router_*`` gauges labelled by worker
        (``vllm_router_worker_health``: 1 healthy; ``vllm_router_cb_state``: 0 closed,
        1 open, 2 half-open)."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.prometheus_port}/metrics", timeout=5
        ) as resp:
            text = resp.read().decode()
        out: dict[str, dict[str, float]] = {}
        for line in text.splitlines():
            m = _SAMPLE_LABEL.match(line)
            if m is None:
                continue
            try:
                out.setdefault(m.group(2), {})[m.group(1)] = float(m.group(3))
            except ValueError:
                continue
        return out

    def worker_routable(self, base_url: str) -> bool:
        """Whether the router now counts ``base_url`` healthy with its circuit breaker
        not open, so the policy may pick it."""
        try:
            state = self.worker_states().get(base_url, {})
        except (urllib.error.URLError, OSError):
            return False
        return (
            state.get("vllm_router_worker_health") == 1
            and state.get("vllm_router_cb_state", 0) != 1
        )

    def metrics(self) -> dict[str, float]:
        """The router's Prometheus samples, each name summed over its labels."""
        with urllib.request.urlopen(
            f"http://127.0.0.1:{self.prometheus_port}/metrics", timeout=5
        ) as resp:
            return parse_prometheus(resp.read().decode())

    def stop(self, timeout_s: float = 10.0) -> None:
        """SIGINT the router's process group, SIGKILL it after ``timeout_s``."""
        if self.proc.poll() is not None:
            return
        _signal_group(self.proc.pid, signal.SIGINT)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            _signal_group(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10.0)


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


def start_vllm_router(
    engines: Sequence[RouterWorker | tuple[str, str | None, str | None]],
    policy: str,
    block_size: int,
    model_name: str,
    log_path: Path,
    extra_args: Sequence[str] = (),
    *,
    timeout_s: float = 60.0,
    binary: str | None = None,
) -> RunningRouter:
    """Start ``vllm-router`` over ``engines`` (``RouterWorker``s or ``(base_url,
    events_endpoint, replay_endpoint)``) and return once it lists every one of them;
    on a failure stop it and raise ``RouterStartError`` with its log (or
    ``RouterMissingError`` where the binary is missing). Engines need not be up: the
    router starts with those that answer and retries the others' requests elsewhere."""
    workers = tuple(w if isinstance(w, RouterWorker) else RouterWorker(*w) for w in engines)
    port, prom = free_port(), free_port()
    cmd = router_command(
        binary or find_router_binary(),
        workers,
        policy,
        block_size,
        model_name,
        port,
        prom,
        extra_args,
    )
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as logf:
        proc = subprocess.Popen(
            cmd,
            stdout=logf,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    router = RunningRouter(proc, port, prom, log_path, workers)
    try:
        deadline = time.monotonic() + timeout_s
        while not router.serving():
            if time.monotonic() > deadline:
                raise RouterStartError(
                    f"{BINARY} not serving within {timeout_s:.0f}s:\n{router.log_tail()}"
                )
            time.sleep(0.2)
        return router
    except BaseException:
        router.stop()
        raise


def wait_until_routable(router: RunningRouter, base_url: str, timeout_s: float = 30.0) -> bool:
    """Poll until the router counts ``base_url`` routable; False at ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not router.worker_routable(base_url):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def received_request_ids(log_text: str) -> list[str]:
    """The request ids (the client's ``x-request-id``) in vLLM's ``Received request``
    lines of an engine log, in order."""
    return [m.group(1) for m in _RECEIVED.finditer(log_text)]


def served_by(engine_logs: Sequence[Path | str], request_ids: Iterable[str]) -> dict[str, int]:
    """For each of ``request_ids``, the index into ``engine_logs`` of the one engine
    whose log received it; -1 where none or several did."""
    seen: dict[str, set[int]] = {}
    for i, log in enumerate(engine_logs):
        try:
            text = Path(log).read_text(errors="replace")
        except OSError:
            continue
        for rid in received_request_ids(text):
            seen.setdefault(rid, set()).add(i)
    out = {}
    for rid in request_ids:
        engines = seen.get(rid, set())
        out[rid] = next(iter(engines)) if len(engines) == 1 else -1
    return out
