"""Request and transfer state, batches and the metadata that crosses processes."""

from __future__ import annotations

import multiprocessing as mp
import pickle

import pytest

from umbp_redis.data import (
    BlockLoadBatch,
    BlockStoreBatch,
    BlockTransferPlan,
    LoadSpec,
    RankTopology,
    RequestTracker,
    StoreEventResult,
    UMBPConnectorMetadata,
    UMBPConnectorWorkerMetadata,
    UMBPHandshakeMetadata,
)


def test_load_spec() -> None:
    LoadSpec(local_tokens=128, external_tokens=384)
    LoadSpec(local_tokens=384, external_tokens=384)
    with pytest.raises(ValueError):
        LoadSpec(local_tokens=256, external_tokens=128)


def test_mark_saved_only_to_block_boundaries_and_never_backwards() -> None:
    t = RequestTracker("r")
    assert t.mark_saved(100, 128) == 0
    assert t.mark_saved(300, 128) == 256
    assert t.mark_saved(200, 128) == 256  # never backwards
    assert t.mark_saved(384, 128) == 384
    with pytest.raises(ValueError):
        t.mark_saved(10, 0)


def test_replace_blocks_after_preemption() -> None:
    t = RequestTracker("r")
    t.append_blocks([[1, 2]])
    t.append_blocks([[3]])
    assert t.block_ids == ([1, 2, 3],)
    t.replace_blocks([[7, 8, 9, 10]])
    assert t.block_ids == ([7, 8, 9, 10],)


def test_store_event_result_merge() -> None:
    a = StoreEventResult(5, 1, frozenset({"k1"}))
    b = StoreEventResult(5, 1, frozenset({"k2"}))
    m = a.merge(b)
    assert m.finished_workers == 2 and m.failed_keys == {"k1", "k2"}
    with pytest.raises(ValueError):
        a.merge(StoreEventResult(6))


def test_batches_are_sequences_of_plans() -> None:
    batch = BlockLoadBatch("req", (b"\x01", b"\x02"), (10, 11), (0, 0), event_id=3)
    assert len(batch) == 2
    first = batch[0]
    assert isinstance(first, BlockTransferPlan) and first.ranges == ()
    assert (first.block_id, first.block_hash, first.request_id) == (10, b"\x01", "req")
    assert [p.block_id for p in batch] == [10, 11]
    assert [p.block_id for p in batch[1:]] == [11]
    with pytest.raises(ValueError, match="differ in length"):
        BlockStoreBatch("req", (b"\x01",), (1, 2), (0,))


def _metadata() -> tuple[UMBPConnectorMetadata, UMBPConnectorWorkerMetadata, UMBPHandshakeMetadata]:
    meta = UMBPConnectorMetadata(
        loads=[BlockLoadBatch("r1", (b"\xaa" * 32,), (4,), (0,), event_id=1)],
        stores=[BlockStoreBatch("r2", (b"\xbb" * 32, b"\xcc" * 32), (5, 6), (0, 0), event_id=2)],
        cancelled_requests=["r3"],
    )
    wmeta = UMBPConnectorWorkerMetadata({2: StoreEventResult(2, 1, frozenset({"k"}))})
    hs = UMBPHandshakeMetadata("abcd", RankTopology(tp_rank=1, tp_size=2))
    return meta, wmeta, hs


def _echo(obj):  # type: ignore[no-untyped-def]
    return obj


def test_metadata_survives_pickle_and_process_boundaries() -> None:
    objs = _metadata()
    for obj in objs:
        assert pickle.loads(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)) == obj
    # vLLM's workers are spawned processes; send the objects through one and back.
    with mp.get_context("spawn").Pool(1) as pool:
        back = pool.map(_echo, objs)
    assert tuple(back) == objs


def test_metadata_survives_vllm_msgpack() -> None:
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    for obj in _metadata():
        enc = MsgpackEncoder()
        dec = MsgpackDecoder(type(obj))
        try:
            assert dec.decode(enc.encode(obj)) == obj
        except TypeError as e:  # vLLM refuses arbitrary objects without pickle fallback
            pytest.fail(f"{type(obj).__name__} not msgpack-serializable: {e}")


def test_worker_metadata_aggregates_across_ranks() -> None:
    r0 = UMBPConnectorWorkerMetadata({1: StoreEventResult(1), 2: StoreEventResult(2)})
    r1 = UMBPConnectorWorkerMetadata({1: StoreEventResult(1, 1, frozenset({"x"}))})
    agg = r0.aggregate(r1)
    assert agg.store_results[1].finished_workers == 2
    assert agg.store_results[1].failed_keys == {"x"}
    assert agg.store_results[2].finished_workers == 1
    assert r0.store_results[1].finished_workers == 1  # inputs unchanged


def test_failed_loads_of_every_rank_are_merged_once() -> None:
    r0 = UMBPConnectorWorkerMetadata({}, (b"a", b"b"), (), ("r1",), (b"x",))
    r1 = UMBPConnectorWorkerMetadata({1: StoreEventResult(1)}, (b"b", b"c"), (b"d",), ("r1",))
    agg = r0.aggregate(r1)
    assert agg.failed_requests == ("r1",) and agg.repaired_loads == (b"d",)
    assert agg.removed_blocks == (b"x",)
    assert agg.failed_loads == (b"a", b"b", b"c") and agg.store_results[1].finished_workers == 1
    assert r0.failed_loads == (b"a", b"b")


def test_one_rank_turning_loads_by_layer_off_reaches_the_scheduler() -> None:
    on, off = UMBPConnectorWorkerMetadata(), UMBPConnectorWorkerMetadata(layer_loads_off=True)
    assert on.aggregate(off).layer_loads_off and off.aggregate(on).layer_loads_off
    assert not on.aggregate(UMBPConnectorWorkerMetadata()).layer_loads_off
