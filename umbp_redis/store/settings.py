"""The store's options of ``kv_connector_extra_config`` and how options are validated.

Every option has a type, a default and a one-line description; this module's table
holds the options of reaching and using Redis (parsed into ``RedisSettings``), the
engine's table (``umbp_redis.engine.options``) the rest. ``docs/configuration.md`` is
checked against both by the tests. An unknown key or a wrong type raises ``ConfigError``
naming the key and what was expected. Options that take true or false also take the
strings "true" and "false".
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote, urlsplit

from umbp_redis.store.errors import ConfigError
from umbp_redis.store.thread_affinity import usable_cpu_count, validate_transfer_cpus


@dataclass(frozen=True)
class Option:
    """One configuration key."""

    name: str
    type: type | tuple[type, ...]
    default: Any
    doc: str
    minimum: float | None = None
    choices: tuple[Any, ...] | None = None


MiB = 1 << 20

REDIS_OPTIONS: tuple[Option, ...] = (
    Option(
        "redis_url",
        (str, type(None)),
        None,
        "Server to use: redis://[[user]:password@]host:port/db, rediss://... (TLS) or "
        "unix:///path/to/socket[?db=N], read as redis-py reads it (redis://name@host names "
        "a user). When unset: $UMBP_REDIS_URL, else redis://localhost:6379/0. The connector "
        "refuses a password in it (vLLM prints kv_connector_extra_config in its startup "
        "log): give it in password_file or $UMBP_REDIS_PASSWORD.",
    ),
    Option("username", (str, type(None)), None, "ACL user name (overrides the URL's)."),
    Option(
        "password_file",
        (str, type(None)),
        None,
        "File whose first line is the Redis password (e.g. a Docker or Kubernetes secret); "
        "keeps it out of vLLM's config and logs. When unset: $UMBP_REDIS_PASSWORD. Never "
        "logged.",
    ),
    Option(
        "tls_ca_cert",
        (str, type(None)),
        None,
        "CA bundle that signs the server's certificate (rediss://).",
    ),
    Option("tls_cert", (str, type(None)), None, "Client certificate for mutual TLS."),
    Option("tls_key", (str, type(None)), None, "Private key of tls_cert."),
    Option("tls_check_hostname", bool, True, "Check that the server certificate names the host."),
    Option(
        "connect_timeout_s", (int, float), 1.0, "Timeout of one connection attempt.", minimum=0.001
    ),
    Option(
        "op_timeout_s",
        (int, float),
        5.0,
        "Timeout of one store or load round trip on one connection.",
        minimum=0.001,
    ),
    Option(
        "lookup_timeout_s",
        (int, float),
        0.25,
        "Timeout of one prefix lookup; past it the blocks count as misses.",
        minimum=0.001,
    ),
    Option(
        "max_connections",
        int,
        8,
        "Connections the process keeps to Redis at most (on a cluster: to each master).",
        minimum=1,
    ),
    Option(
        "transfer_connections",
        (int, str),
        "auto",
        "Connections one large store or load batch is spread over (an int >= 1, or auto). "
        "auto: 1 where fewer than 4 CPUs are usable (the machine's, or fewer where the "
        "container's cgroup limits them to a cpuset or a CPU quota), else 2. Each "
        "connection is a Python "
        "thread receiving; on 2 cores a second one contends with the forward pass and the "
        "Redis server for the cores and the GIL.",
        minimum=1,
    ),
    Option("ttl_seconds", int, 86400, "TTL of every stored value and stored marker.", minimum=1),
    Option(
        "refresh_ttl_on_lookup",
        bool,
        True,
        "A lookup hit re-arms the block's TTL: its stored marker in the same round trip, "
        "its values on the scheduler's marker thread (at most once a second per block); "
        "false: TOUCH (LRU clock) instead.",
    ),
    Option(
        "checksum",
        bool,
        True,
        "Store an xxh3-64 checksum of each payload and require it on load (a value without "
        "one is a miss). false skips computing it on stores and accepts values without one: "
        "faster for large objects, but a damaged value then loads as KV.",
    ),
    Option(
        "fail_fast_s",
        (int, float),
        1.0,
        "After a connection failure, calls fail at once for this long instead of "
        "piling up behind a dead server.",
        minimum=0.0,
    ),
    Option(
        "cluster",
        (str, bool),
        "auto",
        "Whether redis_url names a Redis Cluster node: auto (ask the server with INFO "
        "cluster at startup), true or false. On a cluster keys spread over every master "
        "and the database must be 0.",
        choices=("auto", True, False),
    ),
    Option(
        "cluster_seed_nodes",
        (list, type(None)),
        None,
        'More cluster nodes ("host:port" strings) to read the slot map from when the '
        "node of redis_url is down; same credentials and TLS as redis_url.",
    ),
    Option(
        "cluster_refresh_s",
        (int, float),
        30.0,
        "Cluster slot map re-read at least this often (also at once, in the background, "
        "after MOVED, CLUSTERDOWN or a failed node).",
        minimum=0.1,
    ),
)
OPTIONS_BY_NAME = {o.name: o for o in REDIS_OPTIONS}


def _type_name(t: type | tuple[type, ...]) -> str:
    ts = t if isinstance(t, tuple) else (t,)
    return " or ".join("null" if x is type(None) else x.__name__ for x in ts)


# The words a boolean option takes besides true and false themselves.
BOOL_WORDS = {"true": True, "false": False}


def validate_options(
    extra: Mapping[str, Any] | None,
    *,
    allowed: tuple[Option, ...] = REDIS_OPTIONS,
    ignore_unknown: bool = False,
) -> dict[str, Any]:
    """Every option of ``allowed`` with its value (given or default, "true"/"false"
    read as booleans where the option takes one); raises ``ConfigError`` naming the key
    on a bad value, and on a key not in ``allowed`` unless ``ignore_unknown``."""
    extra = dict(extra or {})
    by_name = {o.name: o for o in allowed}
    unknown = sorted(set(extra) - set(by_name))
    if unknown and not ignore_unknown:
        raise ConfigError(
            f"unknown kv_connector_extra_config key(s) {unknown}; valid keys are {sorted(by_name)}"
        )
    out: dict[str, Any] = {}
    for opt in allowed:
        value = extra.get(opt.name, opt.default)
        types = opt.type if isinstance(opt.type, tuple) else (opt.type,)
        if bool in types and isinstance(value, str) and value.lower() in BOOL_WORDS:
            value = BOOL_WORDS[value.lower()]
        ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
        if not ok:
            raise ConfigError(
                f"kv_connector_extra_config[{opt.name!r}] must be {_type_name(opt.type)}, got "
                f"{type(value).__name__} {value!r}"
            )
        number = isinstance(value, int | float) and not isinstance(value, bool)
        if opt.minimum is not None and number and value < opt.minimum:
            raise ConfigError(
                f"kv_connector_extra_config[{opt.name!r}] must be >= {opt.minimum}, got {value!r}"
            )
        if opt.choices is not None and value not in opt.choices:
            raise ConfigError(
                f"kv_connector_extra_config[{opt.name!r}] must be one of {list(opt.choices)}, "
                f"got {value!r}"
            )
        out[opt.name] = value
    return out


def transfer_connection_count(value: int | str, cpus: int | None = None) -> int:
    """The connection count option ``transfer_connections`` names: ``value`` itself, or
    for ``auto`` 1 where fewer than 4 CPUs are usable (``cpus``, default the CPUs this
    process's container may use: ``usable_cpu_count``), else 2; ``ConfigError`` for any
    other string."""
    if isinstance(value, int):
        return value
    if value != "auto":
        raise ConfigError(
            "kv_connector_extra_config['transfer_connections'] must be an int >= 1 or "
            f"'auto', got {value!r}"
        )
    cpus = cpus if cpus is not None else usable_cpu_count()
    return 1 if cpus < 4 else 2


@dataclass(frozen=True)
class RedisSettings:
    """Where and how to reach Redis, parsed from the options. ``repr`` hides the password.

    Defaults come from the option table, so the two cannot drift apart.
    """

    scheme: str  # "redis", "rediss" or "unix"
    host: str = "localhost"
    port: int = 6379
    path: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = dataclasses.field(default=None, repr=False)
    tls_ca_cert: str | None = OPTIONS_BY_NAME["tls_ca_cert"].default
    tls_cert: str | None = OPTIONS_BY_NAME["tls_cert"].default
    tls_key: str | None = OPTIONS_BY_NAME["tls_key"].default
    tls_check_hostname: bool = OPTIONS_BY_NAME["tls_check_hostname"].default
    connect_timeout_s: float = OPTIONS_BY_NAME["connect_timeout_s"].default
    op_timeout_s: float = OPTIONS_BY_NAME["op_timeout_s"].default
    lookup_timeout_s: float = OPTIONS_BY_NAME["lookup_timeout_s"].default
    max_connections: int = OPTIONS_BY_NAME["max_connections"].default
    # The default is resolved when settings are made, not when this module is imported
    # (``auto`` reads the container's CPU limits).
    transfer_connections: int = dataclasses.field(
        default_factory=lambda: transfer_connection_count(
            OPTIONS_BY_NAME["transfer_connections"].default
        )
    )
    # Bytes of values requested but not yet read, per connection: bounds the server's
    # client output buffers (they count toward maxmemory). Not an option: see
    # docs/configuration.md, "Tuning notes".
    max_inflight_bytes: int = 1 * MiB
    ttl_seconds: int = OPTIONS_BY_NAME["ttl_seconds"].default
    refresh_ttl_on_lookup: bool = OPTIONS_BY_NAME["refresh_ttl_on_lookup"].default
    checksum: bool = OPTIONS_BY_NAME["checksum"].default
    fail_fast_s: float = OPTIONS_BY_NAME["fail_fast_s"].default
    cluster: str = "auto"  # "auto", "on" or "off"
    cluster_seed_nodes: tuple[tuple[str, int], ...] = ()
    cluster_refresh_s: float = OPTIONS_BY_NAME["cluster_refresh_s"].default
    # CPUs the transfer threads run on (``thread_affinity``): "auto", "inherit" or a
    # list. Not an option; benchmarks set it.
    transfer_cpus: str = "auto"

    @property
    def tls(self) -> bool:
        """Whether connections use TLS."""
        return self.scheme == "rediss"

    @property
    def redacted_url(self) -> str:
        """The server address for logs and errors, without credentials."""
        if self.scheme == "unix":
            return f"unix://{self.path}?db={self.db}"
        user = f"{self.username}:***@" if self.username else ("***@" if self.password else "")
        return f"{self.scheme}://{user}{self.host}:{self.port}/{self.db}"

    @classmethod
    def from_url(cls, url: str, **overrides: Any) -> RedisSettings:
        """Settings for ``url`` with other fields from ``overrides``: option names, or
        the fields that are not options (``max_inflight_bytes``, ``transfer_cpus``,
        ``password``: tools, tests and benchmarks set them; a ``password`` overrides
        the URL's)."""
        internal = {
            k: overrides.pop(k)
            for k in ("max_inflight_bytes", "transfer_cpus", "password")
            if k in overrides
        }
        if "transfer_cpus" in internal:
            validate_transfer_cpus(internal["transfer_cpus"])
        settings = cls.from_options({**overrides, "redis_url": url})
        return dataclasses.replace(settings, **internal) if internal else settings

    @classmethod
    def from_options(cls, extra: Mapping[str, Any] | None) -> RedisSettings:
        """Parse and validate the store's options of ``kv_connector_extra_config``
        (other keys are left to the engine's options, which reject unknown ones).

        ``redis_url`` falls back to ``$UMBP_REDIS_URL``, then ``DEFAULT_URL``; the
        password comes from the URL, ``password_file``, then ``$UMBP_REDIS_PASSWORD``,
        in that order (the connector refuses one in its URL: ``refuse_secrets``).
        """
        opts = validate_options(extra, ignore_unknown=True)
        url = opts["redis_url"] or os.environ.get("UMBP_REDIS_URL") or DEFAULT_URL
        parsed = parse_redis_url(url)
        username = opts["username"] or parsed.username
        password = parsed.password
        if password is None and opts["password_file"]:
            password = read_password_file(opts["password_file"])
        if password is None and os.environ.get("UMBP_REDIS_PASSWORD"):
            password = os.environ["UMBP_REDIS_PASSWORD"]
        names = {f.name for f in dataclasses.fields(cls)}
        special = ("username", "password", "cluster", "cluster_seed_nodes")
        rest = {k: v for k, v in opts.items() if k in names and k not in special}
        cluster = {True: "on", False: "off"}.get(opts["cluster"], "auto")
        seeds = parse_seed_nodes(opts["cluster_seed_nodes"])
        rest["transfer_connections"] = transfer_connection_count(opts["transfer_connections"])
        if cluster == "on" and parsed.db != 0:
            raise ConfigError(
                f"kv_connector_extra_config['redis_url'] selects database {parsed.db}, but "
                "kv_connector_extra_config['cluster'] is true and Redis Cluster has only "
                "database 0: use .../0"
            )
        if cluster == "on" and parsed.scheme == "unix":
            raise ConfigError(
                "kv_connector_extra_config['cluster'] is true but redis_url is a unix socket; "
                "a cluster is reached over TCP (redis:// or rediss://)"
            )
        return cls(
            scheme=parsed.scheme,
            host=parsed.host,
            port=parsed.port,
            path=parsed.path,
            db=parsed.db,
            username=username,
            password=password,
            cluster=cluster,
            cluster_seed_nodes=seeds,
            **rest,
        )

    def for_node(self, host: str, port: int) -> RedisSettings:
        """The same credentials, TLS and timeouts for another node of a cluster (db 0)."""
        return dataclasses.replace(self, scheme=self.scheme, host=host, port=port, db=0)

    def redispy_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``redis.Redis`` reaching the same server as this client."""
        kw: dict[str, Any] = {
            "db": self.db,
            "username": self.username,
            "password": self.password,
            "socket_connect_timeout": self.connect_timeout_s,
        }
        if self.scheme == "unix":
            return {**kw, "unix_socket_path": self.path}
        kw.update(host=self.host, port=self.port)
        if self.tls:
            kw.update(
                ssl=True,
                ssl_ca_certs=self.tls_ca_cert,
                ssl_certfile=self.tls_cert,
                ssl_keyfile=self.tls_key,
                ssl_check_hostname=self.tls_check_hostname,
            )
        return kw


DEFAULT_URL = "redis://localhost:6379/0"


@dataclass(frozen=True)
class ParsedURL:
    """The parts of a Redis URL. ``repr`` hides the password."""

    scheme: str
    host: str
    port: int
    path: str | None
    db: int
    username: str | None
    password: str | None = dataclasses.field(default=None, repr=False)


def parse_redis_url(url: str) -> ParsedURL:
    """Parse ``url`` with redis-py's semantics (the connector and the CLI share this).

    ``redis://name@host`` names a user (redis-py then sends ``AUTH name ""``),
    ``redis://:secret@host`` a password, ``redis://name:secret@host`` both; a
    ``db``, ``username`` or ``password`` query argument is honoured as redis-py does.
    Raises ``ConfigError`` naming ``redis_url`` for anything else.
    """
    parts = urlsplit(url)
    scheme = parts.scheme
    if scheme not in ("redis", "rediss", "unix"):
        raise ConfigError(
            f"kv_connector_extra_config['redis_url'] must start with redis://, rediss:// or "
            f"unix://, got scheme {scheme!r}"
        )
    query = {k: v[0] for k, v in parse_qs(parts.query).items() if v}
    username = unquote(parts.username) if parts.username else query.get("username")
    password = unquote(parts.password) if parts.password else query.get("password")
    try:
        if scheme == "unix":
            path: str | None = unquote(parts.path)
            if not path:
                raise ValueError("missing socket path")
            host, port = "localhost", 0
            db = int(query.get("db", "0"))
        else:
            path = None
            host = unquote(parts.hostname) if parts.hostname else "localhost"
            port = parts.port or 6379
            if "db" in query:
                db = int(query["db"])
            else:
                db_text = unquote(parts.path).replace("/", "")
                db = int(db_text) if db_text else 0
    except ValueError as e:
        raise ConfigError(
            f"kv_connector_extra_config['redis_url'] is malformed ({e}); expected "
            "redis://[[user]:password@]host:port/db, rediss://... or unix:///path"
        ) from None
    return ParsedURL(scheme, host, port, path, db, username or None, password or None)


def refuse_secrets(extra: Mapping[str, Any]) -> None:
    """Raise ``ConfigError`` where ``kv_connector_extra_config`` holds a Redis password
    (a ``password`` key, or one in ``redis_url``): vLLM prints that config in its
    startup log. The error names the ways that keep it out of logs and never repeats
    the password."""
    where = None
    if "password" in extra:
        where = "kv_connector_extra_config['password']"
    elif isinstance(extra.get("redis_url"), str):
        try:
            if parse_redis_url(extra["redis_url"]).password is not None:
                where = "A password in kv_connector_extra_config['redis_url']"
        except ConfigError:
            pass  # malformed: the URL's own check reports it without repeating it
    if where is not None:
        raise ConfigError(
            f"{where} is refused: vLLM prints kv_connector_extra_config in its startup "
            "log, so the password would be in every log. Put the password in a file named "
            "by kv_connector_extra_config['password_file'] (e.g. a Docker or Kubernetes "
            "secret) or in the environment variable UMBP_REDIS_PASSWORD, and leave it out "
            "of redis_url (redis://user@host:port/db keeps a user name)."
        )


def parse_seed_nodes(value: list[Any] | None) -> tuple[tuple[str, int], ...]:
    """``["host:port", ...]`` as (host, port) pairs; ``ConfigError`` naming
    ``cluster_seed_nodes`` for anything else."""
    out: list[tuple[str, int]] = []
    for item in value or []:
        host, sep, port = item.rpartition(":") if isinstance(item, str) else ("", "", "")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ConfigError(
                "kv_connector_extra_config['cluster_seed_nodes'] must be a list of "
                f'"host:port" strings, got {item!r}'
            )
        out.append((host.strip("[]"), int(port)))
    return tuple(out)


def read_password_file(path: str) -> str:
    """The first line of ``path`` (without its line break); ``ConfigError`` if unreadable."""
    try:
        with open(path, encoding="utf-8") as f:
            line = f.readline().rstrip("\r\n")
    except OSError as e:
        raise ConfigError(
            f"kv_connector_extra_config['password_file'] {path!r} cannot be read: {e.strerror or e}"
        ) from None
    if not line:
        raise ConfigError(f"kv_connector_extra_config['password_file'] {path!r} is empty")
    return line
