"""What the scheduler half takes from its workers' handshakes."""

from __future__ import annotations

import logging
from collections.abc import Iterable

from umbp_redis.data import RankTopology, UMBPHandshakeMetadata

log = logging.getLogger(__name__)


def agreed_namespace(reports: Iterable[UMBPHandshakeMetadata], mine: RankTopology) -> str | None:
    """The key namespace every worker derived, or None (logged at ERROR) where they
    disagree or report other parallel sizes than ``mine`` (keys would name other ranks).

    Workers derive the namespace: they see the per-layer KV cache specs."""
    reports = list(reports)
    sizes = mine.with_ranks(tp_rank=0, pp_rank=0, pcp_rank=0)
    foreign = [
        m.topology
        for m in reports
        if m.topology.with_ranks(tp_rank=0, pp_rank=0, pcp_rank=0) != sizes
    ]
    if foreign:
        log.error(
            "umbp-redis: a worker reported parallel sizes %s, the scheduler has %s; "
            "disabling lookups",
            foreign[0],
            sizes,
        )
        return None
    spaces = {m.namespace for m in reports}
    if len(spaces) != 1:
        log.error("workers reported namespaces %s; disabling lookups", sorted(spaces))
        return None
    return spaces.pop()
