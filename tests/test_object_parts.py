"""How objects are split into parts for loads by layer (plain data, no server)."""

from __future__ import annotations

from umbp_redis.data.parts import MAX_PARTS, MIN_PART_BYTES, split_layers

KiB = 1 << 10


def names(n: int) -> list[str]:
    return [f"model.layers.{i}.self_attn.attn" for i in range(n)]


def test_a_part_per_layer_down_to_the_minimum_and_up_to_the_maximum() -> None:
    assert split_layers(names(8), 8 * 256 * KiB) == tuple((n,) for n in names(8))
    # 32 layers of 64 KiB (2 MiB): 8 parts of 4 consecutive layers.
    parts = split_layers(names(32), 2 << 20)
    assert [len(p) for p in parts] == [4] * 8
    assert [n for p in parts for n in p] == names(32)
    # Small objects stay whole (version 2 values).
    assert split_layers(names(2), 128 * KiB) == (tuple(names(2)),)
    assert split_layers(names(3), 2 * MIN_PART_BYTES - 1) == (tuple(names(3)),)
    # Many large layers: at most MAX_PARTS, as even as layer counts allow.
    parts = split_layers(names(40), 40 << 20)
    assert len(parts) == MAX_PARTS and {len(p) for p in parts} == {2, 3}
    assert [n for p in parts for n in p] == names(40)
