"""Which CPUs the transfer threads run on (option ``transfer_cpus``).

vLLM's CPU workers bind their OpenMP threads to a set of cores (``OMP_PLACES``,
``GOMP_CPU_AFFINITY`` or ``KMP_AFFINITY``) and leave the others reserved for the engine
loop and helpers. A thread started by the worker's main thread inherits its binding, so
transfer threads would share the forward pass's cores while the reserved ones idle.
``auto`` moves them to the CPUs of the worker's NUMA node that no rank's OpenMP binding
names.
"""

from __future__ import annotations

import glob
import logging
import os
import re
from collections.abc import Callable, Mapping

from umbp_redis.store.errors import ConfigError

log = logging.getLogger(__name__)

AUTO = "auto"
INHERIT = "inherit"

_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def parse_cpu_list(text: str) -> frozenset[int]:
    """CPU ids of a list such as ``"0,2-3"`` (ValueError when it is not one)."""
    cpus: set[int] = set()
    for part in text.replace(" ", ",").split(","):
        if not part:
            continue
        m = _RANGE.match(part)
        if m is None:
            raise ValueError(f"not a CPU id or range: {part!r}")
        lo = int(m.group(1))
        hi = int(m.group(2)) if m.group(2) is not None else lo
        if hi < lo:
            raise ValueError(f"empty CPU range: {part!r}")
        cpus.update(range(lo, hi + 1))
    if not cpus:
        raise ValueError("no CPU named")
    return frozenset(cpus)


def validate_transfer_cpus(value: str) -> str:
    """``value`` when it is ``auto``, ``inherit`` or a CPU list; else ``ConfigError``."""
    if value in (AUTO, INHERIT):
        return value
    try:
        parse_cpu_list(value)
    except ValueError as e:
        raise ConfigError(
            "kv_connector_extra_config['transfer_cpus'] must be 'auto', 'inherit' or a CPU "
            f"list such as '0,2-3', got {value!r} ({e})"
        ) from None
    return value


def omp_bound_cpus(environ: Mapping[str, str]) -> frozenset[int] | None:
    """CPUs the process's OpenMP threads are bound to, as vLLM's CPU executor sets them
    (``OMP_PLACES`` with ``OMP_PROC_BIND``, ``GOMP_CPU_AFFINITY`` or ``KMP_AFFINITY``
    with a ``proclist``); None when no binding is named or it cannot be read."""
    try:
        places = environ.get("OMP_PLACES", "")
        bind = environ.get("OMP_PROC_BIND", "").lower()
        if places and bind not in ("", "false"):
            if "{" not in places or ":" in places:  # abstract names, interval notation
                return None
            return parse_cpu_list(re.sub(r"[{}]", ",", places))
        gomp = environ.get("GOMP_CPU_AFFINITY", "")
        if gomp:
            return parse_cpu_list(gomp)
        kmp = re.search(r"proclist=\[([^\]]*)\]", environ.get("KMP_AFFINITY", ""))
        if kmp:
            return parse_cpu_list(kmp.group(1))
    except ValueError:
        return None
    return None


def vllm_bound_cpus(environ: Mapping[str, str]) -> frozenset[int]:
    """Every CPU an explicit ``VLLM_CPU_OMP_THREADS_BIND`` gives to some rank (lists
    separated by ``|``, one per local rank); empty for ``auto``, ``nobind`` or unset."""
    spec = environ.get("VLLM_CPU_OMP_THREADS_BIND", "")
    if spec in ("", "auto", "nobind"):
        return frozenset()
    try:
        return frozenset().union(*(parse_cpu_list(part) for part in spec.split("|")))
    except ValueError:
        return frozenset()


def numa_node(cpu: int) -> int:
    """The NUMA node of ``cpu`` as sysfs names it (0 where it names none)."""
    for entry in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/node[0-9]*"):
        return int(os.path.basename(entry)[4:])
    return 0


def physical_core(cpu: int) -> tuple[int, int]:
    """(package, core) of ``cpu`` as sysfs names them; SMT siblings share it (the CPU's
    own id where sysfs names none)."""
    base = f"/sys/devices/system/cpu/cpu{cpu}/topology"
    try:
        with open(f"{base}/physical_package_id") as pkg, open(f"{base}/core_id") as core:
            return int(pkg.read()), int(core.read())
    except (OSError, ValueError):
        return -1, cpu


def transfer_cpu_set(
    spec: str,
    environ: Mapping[str, str],
    cpu_count: int,
    node_of: Callable[[int], int] = numa_node,
    core_of: Callable[[int], tuple[int, int]] = physical_core,
) -> frozenset[int] | None:
    """The CPUs transfer threads are moved to for option value ``spec``; None leaves
    them where they start.

    ``auto``: the CPUs on the NUMA nodes of this process's OpenMP binding that neither
    it nor any other rank's explicit ``VLLM_CPU_OMP_THREADS_BIND`` list names (vLLM's
    automatic binding gives each rank its own node and reserves that node's last
    cores), those on physical cores with no bound CPU first (vLLM binds one SMT sibling
    per core: the other shares the core's execution units); None without a binding or
    when nothing is left. ``inherit``: None.
    """
    if spec == INHERIT:
        return None
    if spec != AUTO:
        return parse_cpu_list(spec)
    bound = omp_bound_cpus(environ)
    if bound is None:
        return None
    nodes = {node_of(c) for c in bound}
    taken = bound | vllm_bound_cpus(environ)
    rest = frozenset(c for c in range(cpu_count) if c not in taken and node_of(c) in nodes)
    busy_cores = {core_of(c) for c in taken}
    whole = frozenset(c for c in rest if core_of(c) not in busy_cores)
    return whole or rest or None


class ThreadPinner:
    """Moves the calling thread to the CPUs of ``transfer_cpus`` (a ``ThreadPoolExecutor``
    initializer); a refusal (CPUs outside the process's cpuset) is logged once and the
    thread stays where it is."""

    def __init__(self, spec: str, environ: Mapping[str, str] | None = None) -> None:
        self.spec = validate_transfer_cpus(spec)
        env = os.environ if environ is None else environ
        self.cpus = transfer_cpu_set(spec, env, os.cpu_count() or 1)
        self._warned = False
        self._logged = False

    def __call__(self) -> None:
        """Pin the calling thread (never raises)."""
        if self.cpus is None or not hasattr(os, "sched_setaffinity"):
            return
        try:
            os.sched_setaffinity(0, self.cpus)
        except OSError as e:
            if not self._warned:
                self._warned = True
                log.warning(
                    "umbp-redis: cannot move transfer threads to CPUs %s (transfer_cpus=%r): "
                    "%s; they share the CPUs they started on",
                    sorted(self.cpus),
                    self.spec,
                    e,
                )
            return
        if not self._logged:
            self._logged = True
            log.info(
                "umbp-redis: transfer threads run on CPUs %s (transfer_cpus=%r)",
                sorted(os.sched_getaffinity(0)),
                self.spec,
            )


_pinners: dict[str, ThreadPinner] = {}


def thread_pinner(spec: str) -> ThreadPinner:
    """The process's pinner for ``spec`` (one per value, so each logs once)."""
    if spec not in _pinners:
        _pinners[spec] = ThreadPinner(spec)
    return _pinners[spec]
