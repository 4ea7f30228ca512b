"""The CPU compose stack, end to end, on a Docker daemon of this machine (run as root
through ``scripts/compose_check``).

Steps, each printed with its time: a Docker daemon (started with the vfs storage driver
if none answers, and stopped at the end only if started here); a Debian base image made
offline-capable with debootstrap and ``docker import`` unless ``--base-image`` names one;
the Redis image (``docker/redis.Dockerfile``), the CPU engine image
(``docker/vllm-cpu.Dockerfile``) and the router image (``docker/router.Dockerfile``)
built on it; a tiny random Llama; then ``docker-compose.cpu.yml`` up with two engines
(``--profile second``) behind the router and a password, and the checks. The engines'
own ports serve their ``/metrics`` (per engine: requests finished, prompt tokens loaded
from Redis) and two setup requests; every other completion goes through the router
(``kv_aware``, session affinity). First two sessions are placed on different engines by
the router's KV index: a prompt sent straight to each engine, then again through the
router as a new session's first request, must go to the engine that holds it. Then one
prompt in session 1 and the same prompt in session 2: the router keeps session 2 on its
engine although the other one holds the prompt, so the checks prove that a block stored
by one engine was loaded from Redis by the other: different engines served the two
requests, with the same text; the first engine loaded nothing from Redis and the second
loaded prompt tokens. Then ``umbp-redis ls`` inside the stack lists the keys, Redis runs
with the configured ``maxmemory`` and ``allkeys-lru``, no container's log holds the
password. Last, ``down -v`` and a check that nothing of the project is left. Exit status
0 only if every check passed.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BASE_IMAGE = "umbp-local/debian:bookworm"
REDIS_IMAGE = "umbp-local/redis:7"
ENGINE_IMAGE = "umbp-local/vllm-cpu:0.32.0"
VALKEY_IMAGE = "umbp-local/valkey:8"
ROUTER_IMAGE = "umbp-local/vllm-router:0.1.17"
PROJECT = "umbp-redis-check"
MAXMEMORY = "256mb"
T0 = time.monotonic()


class CheckFailed(Exception):
    """A check of the stack did not hold."""


class MachineUnfit(CheckFailed):
    """This machine cannot run the check: no Docker daemon can start, or the tools it
    needs cannot be installed (``--if-possible`` skips with the reason)."""


def say(msg: str) -> None:
    print(f"[compose_check {time.monotonic() - T0:7.1f}s] {msg}", flush=True)


@contextmanager
def step(name: str) -> Iterator[None]:
    t = time.monotonic()
    say(f"{name} ...")
    yield
    say(f"{name}: done in {time.monotonic() - t:.1f}s")


def run(*cmd: str, env: dict[str, str] | None = None, capture: bool = False) -> str:
    """Run ``cmd``; its stdout when ``capture``; raises CheckFailed on a non-zero exit."""
    out = subprocess.run(
        cmd,
        env={**os.environ, **(env or {})},
        text=True,
        stdout=subprocess.PIPE if capture else None,
        stderr=subprocess.STDOUT if capture else None,
    )
    if out.returncode:
        tail = (out.stdout or "")[-2000:]
        raise CheckFailed(f"{' '.join(cmd[:4])} ... exited {out.returncode}\n{tail}")
    return out.stdout or ""


def apt_install(package: str) -> None:
    """Install a Debian package (refreshing the package lists if the first try fails)."""
    env = {"DEBIAN_FRONTEND": "noninteractive"}
    try:
        run("apt-get", "install", "-y", "-q", package, env=env, capture=True)
    except CheckFailed:
        try:
            run("apt-get", "update", "-q", env=env, capture=True)
            run("apt-get", "install", "-y", "-q", package, env=env, capture=True)
        except CheckFailed as e:
            raise MachineUnfit(f"cannot install {package}: {e}") from None


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=5):
            return True
    except OSError:
        return False


def missing_preconditions() -> str | None:
    """Why this machine cannot run the check (None: it can): root, a package manager or
    Docker, 30 GB free for images (the vfs driver copies each layer), and the Debian
    mirror and PyPI within reach."""
    if os.geteuid() != 0:
        return "not root (it starts dockerd and builds images)"
    if shutil.which("docker") is None and shutil.which("apt-get") is None:
        return "neither docker nor apt-get is installed"
    docker_dir = Path("/var/lib/docker")
    free = shutil.disk_usage(docker_dir if docker_dir.exists() else "/var/lib").free
    if free < 30e9:
        return f"{free / 1e9:.0f} GB free under /var/lib, fewer than the 30 GB the images need"
    for host, port in (("deb.debian.org", 80), ("pypi.org", 443)):
        if not reachable(host, port):
            return f"{host}:{port} is out of reach"
    return None


def docker_answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


class HostFirewall:
    """The host's iptables rules and bridge-filtering switch as they were before a
    dockerd started here, put back after it stops: dockerd leaves its chains and a
    FORWARD policy of DROP behind, which would cut off bridged traffic of other tools."""

    SWITCH = Path("/proc/sys/net/bridge/bridge-nf-call-iptables")

    def __init__(self) -> None:
        self.rules: str | None = None
        if shutil.which("iptables-save") is not None:  # no tool, no rules to put back
            saved = subprocess.run(["iptables-save"], capture_output=True, text=True)
            self.rules = saved.stdout if saved.returncode == 0 else None
        self.switch = self.SWITCH.read_text().strip() if self.SWITCH.exists() else "0"

    def restore(self) -> None:
        """The rules as saved; where there were none, dockerd's chains are flushed and
        removed and FORWARD accepts again (iptables-restore of nothing changes nothing)."""
        if self.rules is not None and shutil.which("iptables-restore") is not None:
            subprocess.run(["iptables-restore"], input=self.rules, text=True, check=False)
            if not self.rules.strip():
                for table in ("filter", "nat"):
                    for op in ("-F", "-X"):
                        subprocess.run(["iptables", "-t", table, op], check=False)
                subprocess.run(["iptables", "-P", "FORWARD", "ACCEPT"], check=False)
        if self.SWITCH.exists():
            self.SWITCH.write_text(self.switch + "\n")


def start_daemon(isolated: bool = False) -> subprocess.Popen[bytes] | None:
    """A dockerd with the vfs storage driver if none answers; None if one did.
    ``isolated``: no bridge and no iptables rules (builds use the host's network), so
    tests running beside it (network namespaces, veth pairs) see the host unchanged."""
    if docker_answers():
        return None
    if shutil.which("dockerd") is None:
        apt_install("docker.io")
    log = open(tempfile.mkstemp(prefix="dockerd-", suffix=".log")[1], "wb")  # noqa: SIM115
    flags = ["--iptables=false", "--bridge=none"] if isolated else []
    proc = subprocess.Popen(["dockerd", "--storage-driver=vfs", *flags], stdout=log, stderr=log)
    for _ in range(120):
        if docker_answers():
            return proc
        if proc.poll() is not None:
            raise MachineUnfit(f"dockerd exited {proc.returncode}: see {log.name}")
        time.sleep(0.5)
    proc.terminate()
    raise MachineUnfit(f"dockerd did not answer within 60 s: see {log.name}")


def image_exists(name: str) -> bool:
    return subprocess.run(["docker", "image", "inspect", name], capture_output=True).returncode == 0


def build_base_image() -> None:
    """Debian bookworm (minbase) by debootstrap, imported as BASE_IMAGE."""
    if shutil.which("debootstrap") is None:
        apt_install("debootstrap")
    with tempfile.TemporaryDirectory(prefix="umbp-rootfs-") as tmp:
        rootfs = Path(tmp) / "rootfs"
        run(
            "debootstrap",
            "--variant=minbase",
            "--include=ca-certificates",
            "bookworm",
            str(rootfs),
            "http://deb.debian.org/debian",
            capture=True,
        )
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        run_in = subprocess.run(["docker", "import", "-", BASE_IMAGE], stdin=tar.stdout)
        tar.wait()
        if run_in.returncode or tar.returncode:
            raise CheckFailed("docker import of the debootstrap tree failed")


def place_build_inputs() -> None:
    """torch's CPU wheel (from pip's find-links folders) into docker/wheels and the
    host's extra CA certificates into docker/certs, for hosts without the PyTorch index
    or behind a TLS-intercepting proxy."""
    wheels = ROOT / "docker" / "wheels"
    for folder in filter(None, os.environ.get("PIP_FIND_LINKS", "/opt/wheels").split()):
        for whl in Path(folder).glob("torch-2.13.0+cpu-cp311-*.whl"):
            if not (wheels / whl.name).exists():
                shutil.copy2(whl, wheels / whl.name)
    certs = ROOT / "docker" / "certs"
    for crt in Path("/usr/local/share/ca-certificates").glob("*.crt"):
        shutil.copy2(crt, certs / crt.name)


def build_valkey_image(binaries: Path, base: str) -> None:
    """VALKEY_IMAGE from ``binaries``' valkey-server and valkey-cli."""
    with tempfile.TemporaryDirectory(prefix="umbp-valkey-") as ctx:
        for name in ("valkey-server", "valkey-cli"):
            shutil.copy2(binaries / name, Path(ctx) / name)
        shutil.copy2(ROOT / "docker" / "valkey.Dockerfile", Path(ctx) / "Dockerfile")
        run(
            "docker",
            "build",
            "-q",
            "--build-arg",
            f"BASE_IMAGE={base}",
            "-t",
            VALKEY_IMAGE,
            ctx,
            capture=True,
        )


def stack_cmd(compose: list[str]) -> list[str]:
    """The compose command of the check's project: the CPU file, both engines and the
    router."""
    return [*compose, "-p", PROJECT, "-f", "docker-compose.cpu.yml", "--profile", "second"]


def redis_cli(up: list[str], env: dict[str, str], *args: str) -> str:
    """What ``redis-cli ARGS`` prints inside the stack's Redis container."""
    return run(*up, "exec", "-T", "redis", "redis-cli", *args, env=env, capture=True)


def server_version(up: list[str], env: dict[str, str]) -> str:
    """``Valkey 8.0.1`` or ``Redis 7.0.15``: what the stack's server says it is."""
    from umbp_redis.store.redispy import server_name

    info = redis_cli(up, env, "info", "server")
    fields = dict(ln.strip().split(":", 1) for ln in info.splitlines() if ":" in ln)
    return server_name(fields)


def compose_cmd() -> list[str]:
    """``docker compose`` (v2) where installed, else ``docker-compose`` (v1.29)."""
    if subprocess.run(["docker", "compose", "version"], capture_output=True).returncode == 0:
        return ["docker", "compose"]
    if shutil.which("docker-compose") is None:
        apt_install("docker-compose")
    return ["docker-compose"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http_json(
    url: str,
    body: dict[str, object] | None = None,
    timeout: float = 120,
    headers: dict[str, str] | None = None,
) -> dict:  # type: ignore[type-arg]
    """The JSON answer to a GET (``body`` None) or a POST of ``body`` as JSON."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(
        url, data=data, headers={"Content-Type": "application/json", **(headers or {})}
    )
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read())  # type: ignore[no-any-return]


def metric(port: int, name: str) -> float:
    """The sum of every sample of ``name`` on the engine's /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and (line[len(name)] in " {"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def restarted_containers() -> list[str]:
    """Containers of the check's project that have restarted (a crashed engine)."""
    label = f"label=com.docker.compose.project={PROJECT}"
    ids = run("docker", "ps", "-aq", "--filter", label, capture=True).split()
    if not ids:
        return []
    out = run("docker", "inspect", "--format", "{{.Name}} {{.RestartCount}}", *ids, capture=True)
    return [name for name, n in (ln.split() for ln in out.splitlines()) if int(n) > 0]


def wait_healthy(port: int, timeout_s: float) -> None:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2):
                return
        except OSError:
            crashed = restarted_containers()
            if crashed:
                raise CheckFailed(f"containers restarted (crashed): {', '.join(crashed)}") from None
            time.sleep(2)
    raise CheckFailed(f"the engine on port {port} was not healthy within {timeout_s:.0f} s")


def check(cond: bool, what: str) -> None:
    if not cond:
        raise CheckFailed(what)
    say(f"ok: {what}")


def project_leftovers() -> list[str]:
    """Containers, networks and volumes still labelled with the check's project."""
    label = f"label=com.docker.compose.project={PROJECT}"
    left = []
    for kind in ("container", "network", "volume"):
        cmd = ["docker", kind, "ls", "-q", "--filter", label]
        if kind == "container":
            cmd.insert(3, "-a")
        left += [f"{kind} {x}" for x in run(*cmd, capture=True).split()]
    return left


FINISHED = "vllm:request_success_total"
LOADED = "vllm:external_prefix_cache_hits_total"


def wait_routable(router: int, timeout_s: float) -> None:
    """Until the router lists both engines as healthy workers (its health checks take
    an engine out while it does not answer and put it back once it does)."""
    end = time.monotonic() + timeout_s
    workers: list[dict] = []  # type: ignore[type-arg]
    while time.monotonic() < end:
        try:
            workers = http_json(f"http://127.0.0.1:{router}/workers", timeout=5)["workers"]
        except OSError:
            workers = []
        if len(workers) == 2 and all(w["is_healthy"] for w in workers):
            return
        time.sleep(2)
    raise CheckFailed(
        f"the router did not list two healthy engines within {timeout_s:.0f} s: {workers}"
    )


def finished(engines: Sequence[int]) -> list[float]:
    """How many requests each engine has finished (its /metrics)."""
    return [metric(p, FINISHED) for p in engines]


def served_by(engines: Sequence[int], before: list[float], expected: int) -> list[int]:
    """Each engine's count of requests finished since ``before``, once they add up to
    ``expected`` (an engine's counters reach /metrics a moment after its answer)."""
    end = time.monotonic() + 30
    while True:
        delta = [int(a - b) for a, b in zip(finished(engines), before, strict=True)]
        if sum(delta) >= expected or time.monotonic() > end:
            return delta
        time.sleep(0.5)


def complete(router: int, body: dict[str, object], session: str, timeout: float = 120) -> str:
    """The text of one completion sent through the router in ``session`` (the
    ``x-session-id`` header its session affinity reads)."""
    try:
        answer = http_json(
            f"http://127.0.0.1:{router}/v1/completions",
            body,
            timeout=timeout,
            headers={"x-session-id": session},
        )
    except urllib.error.HTTPError as e:
        raise CheckFailed(f"the router answered {e.code}: {e.read()[:500]!r}") from None
    return str(answer["choices"][0]["text"])


def routed(
    router: int, engines: Sequence[int], body: dict[str, object], session: str
) -> tuple[str, int]:
    """One completion through the router in ``session``: its text and the index of the
    engine that served it (the one whose finished-requests count rose)."""
    before = finished(engines)
    text = complete(router, body, session)
    delta = served_by(engines, before, 1)
    if sorted(delta) != [0, 1]:
        raise CheckFailed(f"a request routed in session {session} was finished {delta} times")
    return text, delta.index(1)


def pin_sessions(router: int, engines: Sequence[int], model: str) -> tuple[str, str]:
    """Two session ids that the router keeps on engine 1 and engine 2, in that order,
    placed by the router's KV index: a prompt is sent straight to each engine (the only
    requests that bypass the router), so that engine alone holds it and says so in its
    KV events; then each prompt again through the router as a new session's first
    request. The engines' load is equal, so only the index can tell them apart; a
    session then stays on its first engine. Raises CheckFailed where a session's first
    request went to the engine that does not hold its prompt."""
    sessions = ("compose-check-1", "compose-check-2")
    prompts = [
        {"model": model, "prompt": " ".join(f"pin{i}w{j % 89}" for j in range(60)), "max_tokens": 1}
        for i in range(len(engines))
    ]
    for port, body in zip(engines, prompts, strict=True):
        http_json(f"http://127.0.0.1:{port}/v1/completions", body)
    time.sleep(1)  # the engines' events reach the router
    placed = [routed(router, engines, b, s)[1] for b, s in zip(prompts, sessions, strict=True)]
    check(
        placed == [0, 1],
        f"new sessions went to the engine that alone held their prompt (engines "
        f"{[e + 1 for e in placed]}): the router indexes both engines' KV events",
    )
    return sessions


def run_stack(
    compose: list[str], env: dict[str, str], router: int, engines: tuple[int, int]
) -> None:
    password = env["REDIS_PASSWORD"]
    up = stack_cmd(compose)
    with step("compose up (Redis, two CPU engines, the router)"):
        run(*up, "up", "-d", env=env)
        for p in engines:
            wait_healthy(p, 900)
        wait_routable(router, 180)
    say(f"the stack's server: {server_version(up, env)}")
    check(True, "the router lists both engines as healthy workers")
    with step("two sessions placed on different engines by the router's KV index"):
        by_engine = pin_sessions(router, engines, env["MODEL"])
    prompt = " ".join(f"word{i % 97}" for i in range(300))
    body = {"model": env["MODEL"], "prompt": prompt, "max_tokens": 12, "temperature": 0}
    with step("the same prompt through the router in each session"):
        loaded_before = [metric(p, LOADED) for p in engines]
        keys_before = int(redis_cli(up, env, "dbsize"))
        text1, first = routed(router, engines, body, by_engine[0])
        # Engine 1's stores land after its answer: wait until Redis holds more keys than
        # before and their count stopped growing (engine 1's stored-blocks counter on
        # /metrics was once seen to lag behind Redis for a minute, so it is not asked).
        end, seen = time.monotonic() + 60, -1
        while True:
            keys = int(redis_cli(up, env, "dbsize"))
            if keys > keys_before and keys == seen:
                break
            if time.monotonic() > end:
                raise CheckFailed(
                    f"Redis held {keys} keys 60 s after engine 1 answered ({keys_before} before)"
                )
            seen = keys
            time.sleep(1)
        text2, second = routed(router, engines, body, by_engine[1])
        loaded = [metric(p, LOADED) - b for p, b in zip(engines, loaded_before, strict=True)]
    check(
        (first, second) == (0, 1),
        "the router served session 1 on engine 1 and session 2 on engine 2, though engine 1 "
        "held the prompt",
    )
    check(text1 == text2, f"both engines answered the same text ({text1[:40]!r})")
    check(loaded[0] == 0, "engine 1 computed the prompt (it loaded nothing from Redis)")
    check(loaded[1] > 0, f"engine 2 loaded {loaded[1]:.0f} prompt tokens from Redis")
    ls = json.loads(
        run(
            *up,
            "exec",
            "-T",
            "vllm",
            "umbp-redis",
            "ls",
            "--redis-url",
            "redis://redis:6379/0",
            "--json",
            env=env,
            capture=True,
        )
    )
    keys = sum(ls["namespaces"].values())
    check(keys > 0, f"umbp-redis ls inside the stack lists {keys} keys")
    cfg = redis_cli(up, env, "config", "get", "maxmemory*").split()
    conf = dict(zip(cfg[::2], cfg[1::2], strict=False))
    check(
        conf.get("maxmemory") == str(256 << 20) and conf.get("maxmemory-policy") == "allkeys-lru",
        f"Redis runs with maxmemory {MAXMEMORY} and allkeys-lru",
    )
    logs = run(*up, "logs", "--no-color", env=env, capture=True)
    check(password not in logs, f"no container's log ({len(logs)} chars) holds the password")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--valkey",
        type=Path,
        default=None,
        metavar="DIR",
        help="run Valkey instead of Redis: an image built from DIR's valkey-server and "
        "valkey-cli (docker/valkey.Dockerfile)",
    )
    ap.add_argument(
        "--base-image",
        default=None,
        help="a Debian bookworm image to build on (default: one made here by debootstrap)",
    )
    ap.add_argument(
        "--if-possible",
        action="store_true",
        help="exit 0 with the reason when this machine cannot run the check (the test command)",
    )
    ap.add_argument(
        "--build-only",
        action="store_true",
        help="build the images and the model, then stop (a later run finds them built: "
        "the test command builds them while pytest runs)",
    )
    args = ap.parse_args()
    why_not = missing_preconditions()
    if why_not is not None:
        print(f"compose_check skipped: {why_not}", file=sys.stderr)
        return 0 if args.if_possible else 2
    os.chdir(ROOT)
    daemon = None
    compose: list[str] = []
    env: dict[str, str] = {}
    try:
        with step("Docker daemon"):
            firewall = HostFirewall()
            daemon = start_daemon(isolated=args.build_only)
            say("started dockerd (vfs)" if daemon else "a daemon was already running")
        base = args.base_image or BASE_IMAGE
        if args.base_image is None and not image_exists(BASE_IMAGE):
            with step(f"base image {BASE_IMAGE} (debootstrap)"):
                build_base_image()
        compose = compose_cmd()
        place_build_inputs()
        # The same layers either way: the network a build step runs on is not part of
        # its cache key, so the check's own builds reuse what --build-only built.
        build_network = ["--network", "host"] if args.build_only else []
        with step(f"Redis image {REDIS_IMAGE}"):
            run(
                "docker",
                "build",
                "-q",
                *build_network,
                "-f",
                "docker/redis.Dockerfile",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "-t",
                REDIS_IMAGE,
                "docker",
                capture=True,
            )
        server_image = REDIS_IMAGE
        if args.valkey is not None:
            server_image = VALKEY_IMAGE
            with step(f"Valkey image {VALKEY_IMAGE} from {args.valkey}"):
                build_valkey_image(args.valkey, base)
        with step(f"CPU engine image {ENGINE_IMAGE} (cached after the first build)"):
            run(
                "docker",
                "build",
                "-q",
                *build_network,
                "-f",
                "docker/vllm-cpu.Dockerfile",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "--build-arg",
                "TORCH_INDEX_URL=",
                "-t",
                ENGINE_IMAGE,
                ".",
                capture=True,
            )
        with step(f"router image {ROUTER_IMAGE} (cached after the first build)"):
            run(
                "docker",
                "build",
                "-q",
                *build_network,
                "-f",
                "docker/router.Dockerfile",
                "--build-arg",
                f"BASE_IMAGE={base}",
                "-t",
                ROUTER_IMAGE,
                ".",
                capture=True,
            )
        with step("tiny model"):
            from umbp_redis.testing.tiny_model import build_tiny_llama

            models = ROOT / ".umbp-test-cache" / "compose-models"
            build_tiny_llama(models / "tiny-llama")
        if args.build_only:
            say(f"images and model built in {time.monotonic() - T0:.0f} s")
            return 0
        router, engines = free_port(), (free_port(), free_port())
        env = {
            "REDIS_IMAGE": server_image,
            "VLLM_IMAGE": ENGINE_IMAGE,
            "ROUTER_IMAGE": ROUTER_IMAGE,
            "REDIS_PASSWORD": secrets.token_hex(16),
            "UMBP_REDIS_MAXMEMORY": MAXMEMORY,
            "MODEL": "/models/tiny-llama",
            "MODELS_DIR": str(models),
            "MAX_MODEL_LEN": "2048",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_CPU_OMP_THREADS_BIND": "0",
            "VLLM_SECOND_CPU_OMP_THREADS_BIND": str(min(1, (os.cpu_count() or 1) - 1)),
            "ROUTER_PORT": str(router),
            "VLLM_PORT": str(engines[0]),
            "VLLM_SECOND_PORT": str(engines[1]),
            "HF_CACHE": tempfile.mkdtemp(prefix="umbp-hf-"),
            # compose v1.29 gives up on a daemon call after 60 s: removing an engine's
            # container (a full copy of its image under vfs) takes longer on a busy host.
            "COMPOSE_HTTP_TIMEOUT": "600",
        }
        run_stack(compose, env, router, engines)
    except MachineUnfit as e:
        print(f"compose_check skipped: {e}", file=sys.stderr)
        return 0 if args.if_possible else 2
    except CheckFailed as e:
        say(f"FAILED: {e}")
        if compose and env:
            subprocess.run(
                [*stack_cmd(compose), "logs", "--tail=40"],
                env={**os.environ, **env},
            )
        return 1
    finally:
        if compose and env:
            with step("compose down -v"):
                subprocess.run([*stack_cmd(compose), "down", "-v"], env={**os.environ, **env})
        if daemon is not None:
            left = project_leftovers()
            daemon.terminate()
            daemon.wait(30)
            firewall.restore()
            say("stopped the dockerd started here and put the host's iptables rules back")
        else:
            left = project_leftovers() if docker_answers() else []
    if left:
        say(f"FAILED: left behind: {', '.join(left)}")
        return 1
    say("ok: down -v left no container, network or volume of the project")
    say(f"all checks passed in {time.monotonic() - T0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
