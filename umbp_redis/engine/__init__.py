"""The connector's two halves: the scheduler (lookups, plans, pins) and the worker
(transfers), with staging, statistics, the weights fingerprint and the block copiers.
"""
