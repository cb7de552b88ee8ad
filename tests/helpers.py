"""Small utilities the tests share."""
from __future__ import annotations

from collections.abc import Sequence

from common.kv.segments import Segments


def wire_slots(metadata: Sequence[int]) -> list[int]:
    """Every slot kv_append_metadata names, in position order (checked as a daemon checks it)."""
    return Segments.from_wire(list(metadata), sum(metadata[2::2]), num_slots=2**62).slots().tolist()
