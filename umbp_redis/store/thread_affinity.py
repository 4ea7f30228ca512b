"""Which CPUs the transfer threads run on (``RedisSettings.transfer_cpus``, "auto").

vLLM's CPU workers bind their OpenMP threads to a set of cores (``OMP_PLACES``,
``GOMP_CPU_AFFINITY`` or ``KMP_AFFINITY``) and leave the others reserved for the engine
loop and helpers. A thread started by the worker's main thread inherits its binding, so
transfer threads would share the forward pass's cores while the reserved ones idle.
``auto`` lets them run on every CPU of the worker's NUMA node that no other rank is
bound to, so the kernel places them on whichever core is idle.
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
            "transfer_cpus must be 'auto', 'inherit' or a CPU list such as '0,2-3', got "
            f"{value!r} ({e})"
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


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cgroup_dirs(proc_cgroup: str, root: str) -> tuple[str | None, str | None]:
    """The cgroup folders holding this process's CPU quota and cpuset files: for cgroup
    v2 one unified folder, for v1 the ``cpu`` and ``cpuset`` controllers' own."""
    quota_dir = cpuset_dir = None
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if (
            hierarchy == "0"
            and controllers == ""
            and os.path.exists(os.path.join(root, "cgroup.controllers"))
        ):
            own = _own_cgroup(root, path)
            return own, own
        names = controllers.split(",")
        if "cpu" in names:
            quota_dir = _own_cgroup(os.path.join(root, controllers), path)
        if "cpuset" in names:
            cpuset_dir = _own_cgroup(os.path.join(root, controllers), path)
    return quota_dir, cpuset_dir


def _own_cgroup(mount: str, path: str) -> str:
    """The folder of cgroup ``path`` under ``mount``; the mount itself where that path
    is not there (a container sees its own cgroup mounted as the root while
    ``/proc/self/cgroup`` names it by the host's path)."""
    own = os.path.join(mount, path.lstrip("/"))
    return own if os.path.isdir(own) else mount


def usable_cpu_count(
    cpu_count: int | None = None, root: str = "/sys/fs/cgroup", proc_cgroup: str | None = None
) -> int:
    """CPUs this process's container may use: the machine's (``cpu_count``, default
    ``os.cpu_count()``), fewer where its cgroup (v1 or v2) limits it to a cpuset or to a
    CPU quota (a quota of 1.5 CPUs counts as 2). A thread's own affinity is not
    counted: vLLM's CPU worker narrows it to the forward pass's cores, which are not the
    CPUs the transfer threads may run on. Unreadable files limit nothing."""
    cpus = cpu_count if cpu_count is not None else os.cpu_count() or 1
    if proc_cgroup is None:
        proc_cgroup = _read("/proc/self/cgroup") or ""
    quota_dir, cpuset_dir = _cgroup_dirs(proc_cgroup, root)
    if cpuset_dir is not None:
        listed = _read(os.path.join(cpuset_dir, "cpuset.cpus.effective")) or _read(
            os.path.join(cpuset_dir, "cpuset.effective_cpus")
        )
        try:
            if listed:
                cpus = min(cpus, len(parse_cpu_list(listed)))
        except ValueError:
            pass
    if quota_dir is not None:
        quota = _quota_cpus(quota_dir)
        if quota is not None:
            cpus = min(cpus, quota)
    return max(1, cpus)


def _quota_cpus(folder: str) -> int | None:
    """CPUs the CPU quota in cgroup ``folder`` allows, rounded up (v2 ``cpu.max``, else
    v1 ``cpu.cfs_quota_us`` over ``cpu.cfs_period_us``); None without one."""
    v2 = (_read(os.path.join(folder, "cpu.max")) or "").split()
    if len(v2) == 2:
        quota, period = v2
    else:
        quota = _read(os.path.join(folder, "cpu.cfs_quota_us")) or "max"
        period = _read(os.path.join(folder, "cpu.cfs_period_us")) or "0"
    if not (quota.isdigit() and period.isdigit() and int(quota) > 0 and int(period) > 0):
        return None
    return -(-int(quota) // int(period))


def numa_node(cpu: int) -> int:
    """The NUMA node of ``cpu`` as sysfs names it (0 where it names none)."""
    for entry in glob.glob(f"/sys/devices/system/cpu/cpu{cpu}/node[0-9]*"):
        return int(os.path.basename(entry)[4:])
    return 0


def transfer_cpu_set(
    spec: str,
    environ: Mapping[str, str],
    cpu_count: int,
    node_of: Callable[[int], int] = numa_node,
) -> frozenset[int] | None:
    """The CPUs transfer threads may run on for option value ``spec``; None leaves them
    where they start.

    ``auto``: every CPU of the NUMA nodes of this process's OpenMP binding, the bound
    ones included, except those another rank's explicit ``VLLM_CPU_OMP_THREADS_BIND``
    list names (vLLM's automatic binding gives each rank its own node): the kernel then
    runs a transfer on a reserved core while the forward pass computes and on the
    forward's idle cores while it waits. None without a binding, or when that adds no
    CPU to the binding. ``inherit``: None.
    """
    if spec == INHERIT:
        return None
    if spec != AUTO:
        return parse_cpu_list(spec)
    bound = omp_bound_cpus(environ)
    if bound is None:
        return None
    nodes = {node_of(c) for c in bound}
    others = vllm_bound_cpus(environ) - bound
    cpus = frozenset(c for c in range(cpu_count) if node_of(c) in nodes and c not in others)
    return cpus if cpus - bound else None


class ThreadPinner:
    """Sets the calling thread's CPUs from ``transfer_cpus`` (a ``ThreadPoolExecutor``
    initializer); any failure (a refusal: CPUs outside the process's cpuset) is logged
    once and the thread stays where it is."""

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
            where = sorted(os.sched_getaffinity(0))
        except Exception as e:  # an initializer that raises breaks the thread pool
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
                where,
                self.spec,
            )


_pinners: dict[str, ThreadPinner] = {}


def thread_pinner(spec: str) -> ThreadPinner:
    """The process's pinner for ``spec`` (one per value, so each logs once)."""
    if spec not in _pinners:
        _pinners[spec] = ThreadPinner(spec)
    return _pinners[spec]
