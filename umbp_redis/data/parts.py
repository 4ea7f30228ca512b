"""How a stored object is split into parts (value format 3): plain data, no I/O.

An object holds every layer's page of one block, in the forward pass's layer order. It
is stored in parts of consecutive whole layers so that a reader can load the first
layers of many blocks before the last ones (loads by layer). Every engine of a layout
must split alike, so the rule is part of the stored format: its constants are part of
the derived key namespace (``namespace_inputs``), not options.
"""

from __future__ import annotations

from collections.abc import Sequence

MIN_PART_BYTES = 256 << 10
MAX_PARTS = 16
SPLIT_RULE = {"min_part_bytes": MIN_PART_BYTES, "max_parts": MAX_PARTS}


def split_layers(layers: Sequence[str], object_size: int) -> tuple[tuple[str, ...], ...]:
    """Consecutive runs of ``layers``, as even in layer count as they allow: as many as
    there are layers, at most ``MAX_PARTS``, and no more than leave ``MIN_PART_BYTES``
    of ``object_size`` a part (one part for an object under twice that)."""
    n = len(layers)
    count = max(1, min(n, MAX_PARTS, object_size // MIN_PART_BYTES))
    return tuple(tuple(layers[k * n // count : (k + 1) * n // count]) for k in range(count))
