"""Operator tools: the umbp-redis CLI (ls, inspect, stats, purge, doctor), the
benchmarks, the demo, and the private Redis server and tiny model they start.

Not on the connector's import path.
"""
