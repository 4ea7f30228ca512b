"""Model-parallel ranks that hold a shard of each KV object."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@dataclass(frozen=True)
class RankTopology:
    """Model-parallel ranks that take part in one KV object, and this process's place.

    A logical block is stored as one object per rank namespace: each
    (tensor, prefill-context, decode-context, pipeline) rank holds its own shard.
    The decode-context rank is not independent: DCP reuses TP (and PCP) ranks, so
    it is derived from the TP and PCP ranks as vLLM builds its DCP groups.
    """

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    pcp_rank: int = 0
    pcp_size: int = 1
    dcp_rank: int = 0
    dcp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "pcp", "dcp"):
            rank = getattr(self, f"{name}_rank")
            size = getattr(self, f"{name}_size")
            if not isinstance(size, int) or size <= 0:
                raise ValueError(f"RankTopology.{name}_size must be a positive int, got {size!r}")
            if not isinstance(rank, int) or not 0 <= rank < size:
                raise ValueError(
                    f"RankTopology.{name}_rank must satisfy 0 <= rank < {size}, got {rank!r}"
                )
        expected = self.dcp_rank_for(
            self.tp_rank, self.pcp_rank, self.tp_size, self.pcp_size, self.dcp_size
        )
        if self.dcp_rank != expected:
            raise ValueError(
                f"RankTopology.dcp_rank {self.dcp_rank} is inconsistent with tp_rank "
                f"{self.tp_rank} and pcp_rank {self.pcp_rank} (expected {expected})"
            )

    @staticmethod
    def dcp_rank_for(
        tp_rank: int, pcp_rank: int, tp_size: int, pcp_size: int, dcp_size: int
    ) -> int:
        """The DCP rank vLLM gives the process at ``tp_rank``/``pcp_rank``.

        With PCP off, DCP groups are runs of consecutive TP ranks; with PCP on, DCP
        is off, spans the PCP axis, or spans the whole TP x PCP axis.
        """
        if dcp_size == 1:
            return 0
        if pcp_size == 1:
            if tp_size % dcp_size:
                raise ValueError(f"tp_size={tp_size} must be divisible by dcp_size={dcp_size}")
            return tp_rank % dcp_size
        if dcp_size == pcp_size:
            return pcp_rank
        if dcp_size == tp_size * pcp_size:
            return tp_rank * pcp_size + pcp_rank
        raise ValueError(
            f"dcp_size={dcp_size} must be 1, pcp_size={pcp_size} or tp_size*pcp_size="
            f"{tp_size * pcp_size} when PCP is enabled"
        )

    @classmethod
    def from_vllm_config(
        cls,
        vllm_config: VllmConfig,
        *,
        tp_rank: int = 0,
        pp_rank: int = 0,
        pcp_rank: int = 0,
    ) -> RankTopology:
        """Sizes from ``vllm_config.parallel_config``; ranks as given (0 on the scheduler)."""
        pc = vllm_config.parallel_config
        tp = int(pc.tensor_parallel_size)
        pcp = int(pc.prefill_context_parallel_size)
        dcp = int(pc.decode_context_parallel_size)
        return cls(
            tp_rank=tp_rank,
            tp_size=tp,
            pp_rank=pp_rank,
            pp_size=int(pc.pipeline_parallel_size),
            pcp_rank=pcp_rank,
            pcp_size=pcp,
            dcp_rank=cls.dcp_rank_for(tp_rank, pcp_rank, tp, pcp, dcp),
            dcp_size=dcp,
        )

    def with_ranks(self, *, tp_rank: int, pp_rank: int, pcp_rank: int) -> RankTopology:
        """The same sizes seen from another process."""
        return dataclasses.replace(
            self,
            tp_rank=tp_rank,
            pp_rank=pp_rank,
            pcp_rank=pcp_rank,
            dcp_rank=self.dcp_rank_for(
                tp_rank, pcp_rank, self.tp_size, self.pcp_size, self.dcp_size
            ),
        )

    def rank_namespaces(self) -> tuple[RankTopology, ...]:
        """Every process of this topology, in (pp, pcp, tp) order."""
        return tuple(
            self.with_ranks(tp_rank=tp, pp_rank=pp, pcp_rank=pcp)
            for pp in range(self.pp_size)
            for pcp in range(self.pcp_size)
            for tp in range(self.tp_size)
        )

    @property
    def num_rank_namespaces(self) -> int:
        """How many processes hold a shard of each logical block."""
        return self.tp_size * self.pcp_size * self.pp_size

    def rank_label(self, *, tp_agnostic: bool = False) -> str:
        """The rank part of a key: ``tp{tp}:pcp{pcp}:dcp{dcp}:pp{pp}`` (``tp*`` if agnostic)."""
        tp = "*" if tp_agnostic else str(self.tp_rank)
        return f"tp{tp}:pcp{self.pcp_rank}:dcp{self.dcp_rank}:pp{self.pp_rank}"
