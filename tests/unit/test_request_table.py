"""The decode node's request table: the state diagram of decode_node/request_table.py, pages
given back at every end, and a transition the diagram lacks raising."""
from __future__ import annotations

import pytest

from common.engine.core import Engine
from common.kv.segments import Placement, Segments
from decode_node.request_table import ENDS, IllegalTransition, RequestTable, Reservation, Status

S = Status


@pytest.fixture
def table(model) -> RequestTable:
    return RequestTable(Engine(model, num_pages=8, page_size=16))


def _reserve(table: RequestTable, request_id: str) -> object:
    engine = table.engine
    entry = table.add(request_id)
    seq = engine.new_sequence(request_id, list(range(100, 140)), use_prefix_cache=False)
    engine.reserve(seq, 39)
    entry.reservation = Reservation(seq, 0, 39, Placement(Segments.of_slots(range(39))), nonce=7, deadline=0.0)
    table.move(entry, S.RESERVED)
    return entry


@pytest.mark.parametrize("path", [
    [S.RESERVED, S.RECEIVING, S.RECEIVED, S.RUNNING, S.FINISHED],
    [S.RESERVED, S.RECEIVING, S.RESERVED, S.RECEIVING, S.RECEIVING, S.RECEIVED, S.RUNNING, S.ABORTED],
    [S.RESERVED, S.RECEIVED, S.EXPIRED],
    [S.RESERVED, S.RECEIVING, S.FAILED],
    [S.RESERVED, S.ABORTED],
    [S.RUNNING, S.FINISHED],
    [S.ABORTED],
])
def test_the_paths_of_the_diagram(table, path):
    free = table.engine.allocator.num_free
    entry = _reserve(table, "r") if path[0] is S.RESERVED else table.add("r")
    for to in path[path[0] is S.RESERVED:]:
        table.move(entry, to)
        assert entry.status is to
    assert table.get("r") is None and entry.status in ENDS
    if S.RUNNING not in path:  # (the scheduler gives a running request's pages back)
        assert table.engine.allocator.num_free == free


@pytest.mark.parametrize("path, illegal", [
    ([], S.RECEIVING),  # a writer for a request that holds no reservation
    ([S.RESERVED], S.RUNNING),  # generating before the KV arrived
    ([S.RESERVED, S.RECEIVING], S.RUNNING),
    ([S.RUNNING], S.RECEIVED),
    ([S.RUNNING], S.EXPIRED),  # only reservations have leases
    ([S.RESERVED, S.ABORTED], S.RESERVED),  # an ended request never comes back
    ([S.RESERVED, S.ABORTED], S.ABORTED),
])
def test_a_transition_the_diagram_lacks_raises(table, path, illegal):
    entry = _reserve(table, "r") if path[:1] == [S.RESERVED] else table.add("r")
    for to in path[path[:1] == [S.RESERVED]:]:
        table.move(entry, to)
    with pytest.raises(IllegalTransition, match=illegal.name):
        table.move(entry, illegal)


def test_one_live_request_per_id(table):
    table.add("r")
    with pytest.raises(IllegalTransition, match="already live"):
        table.add("r")


@pytest.mark.parametrize("end", [S.ABORTED, S.EXPIRED, S.FAILED])
def test_an_ended_reservation_gives_its_pages_back(table, end):
    free = table.engine.allocator.num_free
    entry = _reserve(table, "r")
    assert table.reserved_pages() == 3 and table.engine.allocator.num_free == free - 3
    assert table.holds_reservation(entry) and table.admitted() == 1
    table.move(entry, end)
    assert table.engine.allocator.num_free == free and table.reserved_pages() == 0
    assert not table.holds_reservation(entry) and not table.counts()


def test_expiry_ends_only_overdue_reservations(table):
    overdue, fresh = _reserve(table, "old"), _reserve(table, "new")
    fresh.reservation.deadline = 1e12
    table.move(overdue, S.RECEIVING)
    expired = table.expire_due(now=1.0)
    assert [(e.request_id, e.status) for e in expired] == [("old", S.RECEIVING)]
    assert overdue.status is S.EXPIRED and table.get("new") is fresh
