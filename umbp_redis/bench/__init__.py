"""Every benchmark: the ``umbp-redis bench`` workloads (data plane, cluster, fleet and the
fleet's engines, workload, client and router) and the focused benchmarks run as
``python -m umbp_redis.bench.NAME``. Not on the connector's import path."""
