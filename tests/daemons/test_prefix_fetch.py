"""Prefixes fetched from the decode node that holds them (GenerateRequest.prefix_holder,
SendPrefix): the fetched prompt's tokens equal the holder's own, a holder that holds less by now
or is gone costs a local prefill, never a wrong token or a stranded page; SendPrefix's bad input
gets a precise status; a router names the holder only when it holds enough more."""
from __future__ import annotations

import json
import re

import grpc
import pytest

from common.peers.membership import Member
from common.peers.routing import Choice
from protos.duet.v1 import duet_pb2 as pb
from router.router import prefix_holder
from harness.helpers import Started, drain, greedy, random_ids, status_of, wait_clean

FLAGS = ("--dtype", "float32", "--threads", "1", "--page-size", "16", "--transport", "tcp")


def _generate(d, request_id: str, prompt: list[int], holder: pb.PrefixHolder | None = None) -> list[int]:
    request = pb.GenerateRequest(request_id=request_id, token_ids=prompt, sampling=greedy(6))
    if holder is not None:
        request.prefix_holder.CopyFrom(holder)
    tokens, last = drain(d.stub.Generate(request, timeout=120))
    assert last.finish_reason == "length"
    return tokens


def _fetched_from(d, request_id: str) -> str | None:
    """The holder a request's prefix came from (its prefix_fetch span), "" when the fetch failed."""
    events = d.stub.GetTrace(pb.GetTraceRequest(request_ids=[request_id]), timeout=10).events
    spans = [json.loads(e.args_json) for e in events if e.name == "prefix_fetch"]
    return (spans[-1].get("prefill") or "") if spans else None


def _peer_tokens(d) -> float:
    match = re.search(r'^duet_prompt_tokens_total\{source="peer"\} (\S+)$', d.metrics_text(), re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_prefix_is_fetched_from_its_holder_or_computed(tmp_path):
    with Started(tmp_path) as s:
        holder, fetcher = s.spawn("decode_node", *FLAGS), s.spawn("decode_node", *FLAGS)
        s.wait()
        history = random_ids(300, seed=21)
        _generate(holder, "h1", history)
        turn = history + random_ids(40, seed=22)

        named = pb.PrefixHolder(address=holder.address, cached_tokens=288)
        fetched = _generate(fetcher, "f1", turn, named)
        assert _fetched_from(fetcher, "f1") == holder.address and _peer_tokens(fetcher) == 288
        assert fetched == _generate(holder, "h2", turn)  # the holder computing the turn itself

        other = random_ids(300, seed=23)  # the holder never saw it: it refuses, the fetcher computes
        assert _generate(fetcher, "f2", other, named) == _generate(holder, "h3", other)
        assert _fetched_from(fetcher, "f2") == ""
        gone = pb.PrefixHolder(address="127.0.0.1:1", cached_tokens=288)
        third = random_ids(300, seed=25)
        assert _generate(fetcher, "f3", third, gone) == _generate(holder, "h4", third)
        assert _fetched_from(fetcher, "f3") == ""
        assert _generate(fetcher, "f4", turn, named) == fetched  # held here now: nothing fetched
        assert _fetched_from(fetcher, "f4") is None and _peer_tokens(fetcher) == 288
        wait_clean(holder, fetcher)

        def send(**changes) -> grpc.StatusCode:
            fields = dict(request_id="x", token_ids=other, kv_window_begin=0, kv_window_end=16,
                          kv_append_metadata=[1, 0, 16], decode_address=fetcher.address)
            request = pb.RemoteSendRequest(**{**fields, **changes})
            return status_of(lambda: holder.stub.SendPrefix(request, timeout=10))

        assert send(kv_window_begin=16) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(kv_append_metadata=[2, 0, 16]) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(token_ids=[10**9]) == grpc.StatusCode.INVALID_ARGUMENT
        assert send(token_ids=random_ids(64, seed=24)) == grpc.StatusCode.FAILED_PRECONDITION  # not held
        wait_clean(holder, fetcher)


@pytest.mark.parametrize("cached, named", [((0, 200), True), ((100, 140), True), ((100, 120), False), ((0, 0), False)])
def test_the_router_names_a_holder_that_holds_enough_more(cached, named):
    chosen, other = (Choice(Member(f"n{i}", None, None), c, 0.0) for i, c in enumerate(cached))
    holder = prefix_holder(chosen, [chosen, other], min_tokens=32)
    assert (holder is not None) == named
    if named:
        assert (holder.address, holder.cached_tokens) == ("n1", cached[1])
