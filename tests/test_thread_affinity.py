"""Transfer threads off the CPUs vLLM binds its OpenMP threads to (``transfer_cpus``)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from umbp_redis.engine.options import parse_connector_options
from umbp_redis.store import thread_affinity
from umbp_redis.store.errors import ConfigError
from umbp_redis.store.plane import LoadStatus, RedisDataPlane
from umbp_redis.store.settings import RedisSettings
from umbp_redis.store.thread_affinity import (
    ThreadPinner,
    omp_bound_cpus,
    parse_cpu_list,
    transfer_cpu_set,
    usable_cpu_count,
)

FP = b"\x05" * 16


def test_cpu_lists_parse_and_bad_ones_name_the_option() -> None:
    assert parse_cpu_list("0,2-3") == {0, 2, 3}
    assert parse_cpu_list("5") == {5}
    for bad in ("", "a", "3-1", "1-"):
        with pytest.raises(ValueError):
            parse_cpu_list(bad)
    for ok in ("auto", "inherit", "0-1"):
        assert RedisSettings.from_url("redis://h:1", transfer_cpus=ok).transfer_cpus == ok
    with pytest.raises(ConfigError, match=r"transfer_cpus must be 'auto', 'inherit'"):
        RedisSettings.from_url("redis://h:1", transfer_cpus="cores")
    # Not an option: the connector's config refuses it, naming what it does instead.
    with pytest.raises(ConfigError, match=r"transfer_cpus.*no longer an option.*NUMA"):
        parse_connector_options({"transfer_cpus": "inherit"})
    with pytest.raises(ConfigError, match="transfer_cpus"):
        ThreadPinner("0-x")


def test_the_openmp_binding_is_read_as_vllm_writes_it() -> None:
    # vLLM's CPU executor: OMP_PLACES + OMP_PROC_BIND (libgomp without LD_PRELOAD),
    # GOMP_CPU_AFFINITY (libgomp preloaded) or KMP_AFFINITY (Intel OpenMP).
    assert omp_bound_cpus({"OMP_PLACES": "{0,1,2}", "OMP_PROC_BIND": "true"}) == {0, 1, 2}
    assert omp_bound_cpus({"GOMP_CPU_AFFINITY": "4 5 6"}) == {4, 5, 6}
    kmp = "granularity=fine,explicit,proclist=[2,3]"
    assert omp_bound_cpus({"KMP_AFFINITY": kmp}) == {2, 3}
    # No binding, places without binding, or a form it does not read: none known.
    for env in (
        {},
        {"OMP_PLACES": "{0}"},
        {"OMP_PLACES": "cores", "OMP_PROC_BIND": "true"},
        {"OMP_PLACES": "{0}:4", "OMP_PROC_BIND": "close"},
    ):
        assert omp_bound_cpus(env) is None


def test_auto_widens_the_binding_to_the_free_cpus() -> None:
    def one_node(cpu: int) -> int:
        return 0

    bound = {"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    assert transfer_cpu_set("auto", bound, 4, one_node) == {0, 1, 2, 3}
    assert transfer_cpu_set("auto", bound, 2, one_node) is None  # nothing to add: stay
    assert transfer_cpu_set("auto", {}, 4, one_node) is None  # no binding: stay
    assert transfer_cpu_set("inherit", bound, 4, one_node) is None
    assert transfer_cpu_set("1,3", {}, 4, one_node) == {1, 3}


def test_auto_never_takes_another_ranks_cpus() -> None:
    """TP=2 with explicit lists: rank 0 never gets rank 1's list; on 2 cores ("0|1")
    nothing is added and the threads stay."""

    def one_node(cpu: int) -> int:
        return 0

    rank0 = {"OMP_PLACES": "{0,1}", "OMP_PROC_BIND": "true"}
    explicit = {**rank0, "VLLM_CPU_OMP_THREADS_BIND": "0-1|2-3"}
    assert transfer_cpu_set("auto", explicit, 6, one_node) == {0, 1, 4, 5}
    two_cores = {"OMP_PLACES": "{0}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    assert transfer_cpu_set("auto", two_cores, 2, one_node) is None

    # vLLM's automatic binding gives each rank a NUMA node: only this rank's node counts.
    def two_nodes(cpu: int) -> int:
        return cpu // 4

    rank1 = {"OMP_PLACES": "{4,5,6}", "OMP_PROC_BIND": "true", "VLLM_CPU_OMP_THREADS_BIND": "auto"}
    assert transfer_cpu_set("auto", rank1, 8, two_nodes) == {4, 5, 6, 7}


def _allowed(native_id: int) -> set[int]:
    status = Path(f"/proc/self/task/{native_id}/status").read_text()
    line = next(x for x in status.splitlines() if x.startswith("Cpus_allowed_list:"))
    return set(parse_cpu_list(line.split(":", 1)[1].strip()))


@pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs Linux thread affinity and at least 2 CPUs (one bound, one free)",
)
@pytest.mark.parametrize("spec", ["auto", "inherit"])
def test_transfer_threads_may_leave_the_forward_pass_cpu(
    spec: str, redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread bound like vLLM's worker thread (one CPU, named by OMP_PLACES) starts
    the data plane's transfer threads: with auto they may run on every CPU, with
    inherit only on the bound one; loads work either way."""
    cpus = sorted(os.sched_getaffinity(0))
    forward_cpu, rest = cpus[0], set(cpus[1:])
    monkeypatch.setenv("OMP_PLACES", f"{{{forward_cpu}}}")
    monkeypatch.setenv("OMP_PROC_BIND", "true")
    monkeypatch.setattr(thread_affinity, "_pinners", {})
    n, size = 8, 1 << 20
    data = np.random.default_rng(3).integers(0, 256, (n, size), dtype=np.uint8)
    keys = [f"umbp:test:affinity:{spec}:{i}" for i in range(n)]
    seen: dict[str, set[int]] = {}

    def bound_worker() -> None:
        os.sched_setaffinity(0, {forward_cpu})
        plane = RedisDataPlane(
            RedisSettings.from_url(redis_url, transfer_connections=3, transfer_cpus=spec)
        )
        try:
            plane.store([(k, data[i]) for i, k in enumerate(keys)], FP)
            out = np.zeros_like(data)
            res = plane.load([(k, out[i]) for i, k in enumerate(keys)], FP)
            seen["ok"] = {int(all(s is LoadStatus.LOADED for s in res) and (out == data).all())}
            for t in plane._executor._threads:  # this plane's transfer threads
                assert t.native_id is not None
                seen[t.name] = _allowed(t.native_id)
        finally:
            plane.close()

    t = threading.Thread(target=bound_worker)
    t.start()
    t.join()
    assert seen.pop("ok") == {1}
    assert seen, "the load fanned out to no transfer thread"
    want = {forward_cpu, *rest} if spec == "auto" else {forward_cpu}
    assert all(allowed == want for allowed in seen.values()), seen


def test_a_refused_cpu_set_leaves_the_thread_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pin = ThreadPinner("100000")  # no such CPU: the kernel refuses the mask
    before = os.sched_getaffinity(0)
    pin()
    pin()
    assert os.sched_getaffinity(0) == before
    assert sum("cannot move transfer threads" in r.message for r in caplog.records) == 1


def test_a_pinner_that_fails_never_breaks_the_thread_pool(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A ThreadPoolExecutor whose initializer raises refuses all work: the pinner
    swallows any failure, so transfers still run."""
    from concurrent.futures import ThreadPoolExecutor

    def broken(pid: int, cpus: object) -> None:
        raise RuntimeError("no affinity here")

    monkeypatch.setattr(os, "sched_setaffinity", broken)
    with ThreadPoolExecutor(1, initializer=ThreadPinner("0")) as pool:
        assert pool.submit(lambda: 42).result() == 42


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text + "\n")


def test_usable_cpus_are_the_containers_not_the_threads(tmp_path: Path) -> None:
    """``auto`` connection counts read how many CPUs the container may use: a cgroup v2
    or v1 CPU quota (rounded up) or cpuset lowers the machine's count; no limit, or
    files that cannot be read, leave it; a thread's own affinity is not counted."""
    v2 = tmp_path / "v2"
    _write(v2 / "cgroup.controllers", "cpuset cpu memory")
    _write(v2 / "pod" / "cpu.max", "150000 100000")
    _write(v2 / "pod" / "cpuset.cpus.effective", "0-63")
    assert usable_cpu_count(64, str(v2), "0::/pod") == 2
    _write(v2 / "pod" / "cpu.max", "max 100000")
    assert usable_cpu_count(64, str(v2), "0::/pod") == 64
    _write(v2 / "pod" / "cpuset.cpus.effective", "4-6")
    assert usable_cpu_count(64, str(v2), "0::/pod") == 3

    v1 = tmp_path / "v1"
    cgroup = "12:cpuset:/\n4:cpu,cpuacct:/job\n1:name=systemd:/\n"
    _write(v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "300000")
    _write(v1 / "cpu,cpuacct" / "job" / "cpu.cfs_period_us", "100000")
    _write(v1 / "cpuset" / "cpuset.effective_cpus", "0-15")
    assert usable_cpu_count(16, str(v1), cgroup) == 3
    _write(v1 / "cpu,cpuacct" / "job" / "cpu.cfs_quota_us", "-1")
    assert usable_cpu_count(16, str(v1), cgroup) == 16
    _write(v1 / "cpuset" / "cpuset.effective_cpus", "0,2")
    assert usable_cpu_count(16, str(v1), cgroup) == 2

    # A container whose cgroup is mounted as the root, named by the host's path.
    inner = tmp_path / "inner"
    _write(inner / "cpu,cpuacct" / "cpu.cfs_quota_us", "200000")
    _write(inner / "cpu,cpuacct" / "cpu.cfs_period_us", "100000")
    assert usable_cpu_count(16, str(inner), "4:cpu,cpuacct:/docker/0123abcd\n") == 2

    assert usable_cpu_count(8, str(tmp_path / "none"), "0::/") == 8  # nothing readable
    _write(tmp_path / "bad" / "cgroup.controllers", "cpu")
    _write(tmp_path / "bad" / "cpu.max", "lots 100000")
    _write(tmp_path / "bad" / "cpuset.cpus.effective", "zero-two")
    assert usable_cpu_count(8, str(tmp_path / "bad"), "0::/") == 8

    # This process: its own thread pinned to one CPU still counts every usable CPU.
    if hasattr(os, "sched_setaffinity") and len(os.sched_getaffinity(0)) > 1:
        before = os.sched_getaffinity(0)
        whole = usable_cpu_count()
        os.sched_setaffinity(0, {min(before)})
        try:
            assert usable_cpu_count() == whole
        finally:
            os.sched_setaffinity(0, before)
