"""The router's block index and node ranking (common/peers/kv_index.py, routing.py), without daemons;
tests/daemons/test_kv_routing.py runs them against real nodes."""
from __future__ import annotations

import time

import pytest

from common.kv.block_hashes import block_hashes
from common.peers.kv_index import KvIndex
from common.peers.membership import Member
from common.peers.routing import NodeChooser, RoutingPolicy
from protos.duet.v1 import duet_pb2 as pb

PS = 4
PROMPT = list(range(100, 120))  # five blocks


def node(address: str, running: int = 0, queued_tokens: int = 0) -> Member:
    return Member(address, channel=None, stub=None, healthy=True,
                  load=pb.NodeLoad(running_requests=running, queued_prefill_tokens=queued_tokens))


def snapshot(blocks: list[int], incarnation: str = "a", sequence: int = 5) -> pb.KvEvent:
    return pb.KvEvent(incarnation=incarnation, sequence=sequence, snapshot=True, stored_blocks=blocks, block_size=PS)


def test_blocks_on_a_nodes_disk_tier_count_as_held_and_its_snapshot_replaces_only_them():
    index = KvIndex()
    hashes = block_hashes(PROMPT, PS)
    assert index.apply("n", snapshot(hashes[:1]))
    disk = pb.KvEvent(incarnation="a", sequence=5, snapshot=True, stored_blocks=hashes[1:3], block_size=PS,
                      medium="disk")  # the second half of the snapshot, at its sequence
    assert index.apply("n", disk)
    assert index.cached_tokens(["n"], PROMPT) == {"n": 3 * PS} and index.num_blocks("n") == 1
    assert index.apply("n", pb.KvEvent(incarnation="a", sequence=6, removed_blocks=hashes[2:3], medium="disk"))
    assert index.apply("n", pb.KvEvent(incarnation="a", sequence=7, stored_blocks=hashes[3:4], block_size=PS))
    assert index.cached_tokens(["n"], PROMPT) == {"n": 2 * PS}  # the run stops at the block gone from disk
    assert not index.apply("n", pb.KvEvent(incarnation="a", sequence=9, stored_blocks=hashes[2:3], medium="disk"))
    assert index.apply("n", snapshot([], sequence=9))  # a pool snapshot forgets the disk's blocks too
    assert index.cached_tokens(["n"], PROMPT) == {"n": 0}


def test_the_index_applies_events_in_order_and_refuses_what_does_not_follow():
    index = KvIndex()
    hashes = block_hashes(PROMPT, PS)
    assert not index.apply("n", pb.KvEvent(incarnation="a", sequence=1, stored_blocks=hashes))  # no snapshot yet
    assert index.apply("n", snapshot(hashes[:2]))
    assert index.cached_tokens(["n", "unknown"], PROMPT) == {"n": 2 * PS, "unknown": 0}
    assert index.apply("n", pb.KvEvent(incarnation="a", sequence=6, stored_blocks=hashes[2:4], block_size=PS))
    assert index.cached_tokens(["n"], PROMPT) == {"n": 4 * PS}
    assert not index.apply("n", pb.KvEvent(incarnation="a", sequence=8, removed_blocks=hashes[:1]))  # a gap
    assert not index.apply("n", pb.KvEvent(incarnation="b", sequence=7, removed_blocks=hashes[:1]))  # restarted
    assert index.resume_point("n") == ("a", 6)
    assert index.apply("n", pb.KvEvent(incarnation="a", sequence=7, removed_blocks=hashes[1:2], block_size=PS))
    assert index.cached_tokens(["n"], PROMPT) == {"n": PS}  # a prefix match stops at the first missing block
    assert index.apply("n", snapshot([], incarnation="b", sequence=0))  # a restarted node's snapshot replaces
    assert index.cached_tokens(["n"], PROMPT) == {"n": 0} and index.num_blocks("n") == 0
    index.forget("n")
    assert index.resume_point("n") is None


def test_a_routed_prompt_counts_as_held_until_it_expires_or_is_removed():
    index = KvIndex(prediction_seconds=0.2)
    index.note_routed("n", PROMPT)  # block size unknown yet: nothing predicted
    assert index.apply("n", snapshot([]))
    index.note_routed("n", PROMPT)
    assert index.cached_tokens(["n"], PROMPT + [1, 2]) == {"n": 20}
    first = block_hashes(PROMPT, PS)[0]
    assert index.apply("n", pb.KvEvent(incarnation="a", sequence=6, removed_blocks=[first], block_size=PS))
    assert index.cached_tokens(["n"], PROMPT) == {"n": 0}
    index.note_routed("n", PROMPT)
    time.sleep(0.25)
    assert index.cached_tokens(["n"], PROMPT) == {"n": 0}


def test_prefix_routing_follows_the_cache_until_the_load_outweighs_it():
    index = KvIndex()
    index.apply("warm", snapshot(block_hashes(PROMPT, PS)))
    index.apply("cold", snapshot([]))
    chooser = NodeChooser(RoutingPolicy("prefix", load_weight=4.0), index)
    warm, cold = node("warm", running=2), node("cold")
    best = chooser.rank([cold, warm], PROMPT)[0]
    assert (best.member, best.cached_tokens, best.cost) == (warm, 20, 0 + 4.0 * 2)
    warm.in_flight = 6  # requests in flight from here count beside those the report counts
    assert chooser.rank([cold, warm], PROMPT)[0].member is cold
    warm.in_flight, cold.load.queued_prefill_tokens = 0, 100  # so do queued prompt tokens
    assert chooser.rank([cold, warm], PROMPT)[0].member is warm
    cold.load.queued_prefill_tokens = 0
    warm.load.running_requests, warm.in_flight_at_poll = 8, 6  # the report counted 6 of ours, since ended
    assert chooser.rank([cold, warm], PROMPT)[0].cost == 4.0 * 2


def test_load_routing_ignores_the_cache_and_breaks_ties_by_requests_sent():
    index = KvIndex()
    index.apply("warm", snapshot(block_hashes(PROMPT, PS)))
    chooser = NodeChooser(RoutingPolicy("load"), index)
    a, b = node("warm"), node("b")
    picks = []
    for _ in range(4):
        choice = chooser.rank([a, b], PROMPT)[0]
        assert choice.cached_tokens == 0
        chooser.note_routed(choice.member, PROMPT)
        picks.append(choice.member.address)
    assert sorted(picks) == ["b", "b", "warm", "warm"]
    assert index.cached_tokens(["b"], PROMPT) == {"b": 0}  # load routing predicts nothing
    b.load.running_requests = 1
    assert chooser.rank([a, b], PROMPT)[0].member is a


def test_round_robin_takes_the_nodes_in_turn():
    chooser = NodeChooser(RoutingPolicy("round-robin"), None)
    members = [node("c"), node("a", running=9), node("b")]
    assert [chooser.rank(members, PROMPT)[0].member.address for _ in range(4)] == ["a", "b", "c", "a"]
    assert chooser.rank([], PROMPT) == []


def test_bad_policies_are_refused():
    for mode, weight in (("nearest", 1.0), ("prefix", -1.0), ("load", float("nan"))):
        with pytest.raises(ValueError):
            RoutingPolicy(mode, weight)
