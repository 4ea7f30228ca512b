"""OpenAI-server vLLM engines for the fleet benchmark: start, pin, scrape, stop.

Each engine is ``python -m vllm.entrypoints.openai.api_server`` in a process group of
its own, its forward pass bound to one core (``VLLM_CPU_OMP_THREADS_BIND``) on a CPU
machine, its log in a file of the run's folder.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from umbp_redis.testing.embedded_redis import free_port

# The engine's Prometheus counters the benchmark reads (vLLM's and the connector's).
PREFIX_HITS = "vllm:prefix_cache_hits_total"
PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
EXTERNAL_QUERIES = "vllm:external_prefix_cache_queries_total"

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([-+0-9.eEinfNa]+)\s*$")


class EngineStartError(RuntimeError):
    """An engine exited or did not become ready in time; carries its log's tail."""


@dataclass(frozen=True)
class EngineSpec:
    """What one engine runs: model, KV cache size, connector config, cores."""

    model: str
    num_blocks: int
    cpus: str  # VLLM_CPU_OMP_THREADS_BIND value, e.g. "0"
    kv_transfer_config: dict[str, object] | None = None
    max_model_len: int = 4096
    dtype: str = "float32"
    extra_env: tuple[tuple[str, str], ...] = ()
    port: int = 0  # 0: a free port when it starts
    block_size: int | None = None  # None: vLLM's default (128 on the CPU backend)
    # Behind a router process: prefix caching on and explicit, text prompts rendered
    # for the router (--enable-scale-out), each request's id logged (--enable-log-requests).
    behind_router: bool = False
    # Set: the engine publishes its KV events (vLLM's --kv-events-config) to the router.
    kv_events_config: dict[str, object] | None = None

    def command(self, port: int) -> list[str]:
        """The engine's command line."""
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            self.model,
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--dtype",
            self.dtype,
            "--max-model-len",
            str(self.max_model_len),
            "--num-gpu-blocks-override",
            str(self.num_blocks),
            "--enable-prompt-tokens-details",
            "--disable-uvicorn-access-log",
            "--seed",
            "0",
        ]
        if self.block_size is not None:
            cmd += ["--block-size", str(self.block_size)]
        if self.behind_router:
            cmd += ["--enable-prefix-caching", "--enable-scale-out", "--enable-log-requests"]
        if self.kv_events_config is not None:
            cmd += ["--kv-events-config", json.dumps(self.kv_events_config)]
        if self.kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(self.kv_transfer_config)]
        return cmd

    def environment(self) -> dict[str, str]:
        """The engine's environment: this process's, with the CPU binding and KV space."""
        env = dict(os.environ)
        env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.update(dict(self.extra_env))
        return env


@dataclass
class RunningEngine:
    """An engine process and where it answers."""

    spec: EngineSpec
    port: int
    proc: subprocess.Popen[bytes]
    log_path: Path
    started_at: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the engine's log."""
        return log_tail(self.log_path, chars)

    def ready(self) -> bool:
        """Whether ``/health`` answers 200 (raises ``EngineStartError`` if it exited)."""
        if self.proc.poll() is not None:
            raise EngineStartError(
                f"engine on port {self.port} exited with {self.proc.returncode}:\n"
                + self.log_tail()
            )
        try:
            with urllib.request.urlopen(self.base_url + "/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def cpu_seconds(self) -> dict[str, float]:
        """CPU seconds so far of the engine's processes, by process name."""
        return process_cpu_seconds(self.proc.pid)

    def metrics(self) -> dict[str, float]:
        """The engine's Prometheus samples, each name summed over its labels."""
        with urllib.request.urlopen(self.base_url + "/metrics", timeout=10) as resp:
            return parse_prometheus(resp.read().decode())

    def interrupt(self) -> None:
        """SIGINT the engine's process group (vLLM's orderly shutdown) if it runs."""
        self._signal(signal.SIGINT)

    def wait_or_kill(self, timeout_s: float = 20.0) -> None:
        """Wait ``timeout_s`` for the engine to exit, then SIGKILL its process group."""
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._signal(signal.SIGKILL)
            self.proc.wait(10.0)

    def _signal(self, sig: signal.Signals) -> None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass


def log_tail(path: Path, chars: int = 3000) -> str:
    """The last ``chars`` characters of the log at ``path`` ("" where it cannot be read)."""
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def process_cpu_seconds(pgid: int) -> dict[str, float]:
    """CPU seconds (user + system) so far of every process in process group ``pgid``,
    summed by process name (vLLM names its processes: ``VLLM::EngineCor``,
    ``VLLM::Worker``..., the API server keeps the interpreter's); {} off Linux."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[str, float] = {}
    try:
        entries = os.listdir("/proc")
    except OSError:
        return out
    for entry in entries:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1 : stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) != pgid:  # fields[2] is the process group
            continue
        cpu = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
        out[name] = out.get(name, 0.0) + cpu
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """Prometheus text exposition to {sample name: value summed over label sets}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out[m.group(1)] = out.get(m.group(1), 0.0) + value
    return out


def start_engines(
    specs: Sequence[EngineSpec], log_dir: Path, *, timeout_s: float = 300.0, first_index: int = 0
) -> list[RunningEngine]:
    """Start every engine at once and wait until all answer ``/health``; on a failure
    stop them all and raise ``EngineStartError`` with the failing engine's log. Logs are
    named by engine index, counted from ``first_index``, and port."""
    log_dir.mkdir(parents=True, exist_ok=True)
    engines: list[RunningEngine] = []
    try:
        for i, spec in enumerate(specs, first_index):
            port = spec.port or free_port()
            log_path = log_dir / f"engine{i}-{port}.log"
            with open(log_path, "wb") as logf:
                proc = subprocess.Popen(
                    spec.command(port),
                    env=spec.environment(),
                    stdout=logf,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            engines.append(RunningEngine(spec, port, proc, log_path))
        deadline = time.monotonic() + timeout_s
        waiting = list(engines)
        while waiting:
            waiting = [e for e in waiting if not e.ready()]
            if waiting and time.monotonic() > deadline:
                raise EngineStartError(
                    f"engine on port {waiting[0].port} not ready within {timeout_s:.0f}s:\n"
                    + waiting[0].log_tail()
                )
            if waiting:
                time.sleep(0.5)
        return engines
    except BaseException:
        stop_engines(engines)
        raise


def stop_engines(engines: Sequence[RunningEngine]) -> None:
    """Stop every engine (they shut down in parallel)."""
    for e in engines:
        e.interrupt()
    for e in engines:
        e.wait_or_kill()
