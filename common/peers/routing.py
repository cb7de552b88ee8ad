"""Choosing a node for a prompt: the one function the router (decode and prefill nodes) and the
decode node (prefill nodes) both rank with.

A node's cost is the prompt tokens it would have to compute for this request (those it does not
hold in its prefix cache, as its KV events report them), plus the prompt tokens already queued
there, plus `load_weight` tokens for each request it is running or queueing. The request count
is the node's last report (up to a poll period old) corrected by this process's own requests
(`Member.active_requests`): a conversation's next turn, sent as the previous one ends, must not
find its node still looking busy with that turn. Cheapest first; ties go to the node sent fewer
requests.

- ``prefix``: the cost above.
- ``load``: the same without the cache term, so every node looks cold.
- ``round-robin``: the healthy nodes in turn, whatever their cache or load.
"""
from __future__ import annotations

import argparse
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from common.peers.kv_index import KvIndex
from common.peers.membership import Member

ROUTING_MODES = ("prefix", "load", "round-robin")
DEFAULT_LOAD_WEIGHT = 256.0


@dataclass(frozen=True)
class RoutingPolicy:
    mode: str = "prefix"
    load_weight: float = DEFAULT_LOAD_WEIGHT  # prompt tokens one running or queued request costs

    def __post_init__(self) -> None:
        if self.mode not in ROUTING_MODES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_MODES)}, got {self.mode!r}")
        if not self.load_weight >= 0:
            raise ValueError("--load-weight must be >= 0")


@dataclass(frozen=True)
class Choice:
    member: Member
    cached_tokens: int  # prompt tokens the node is believed to hold (0 unless routing by prefix)
    cost: float


def add_routing_args(parser: argparse.ArgumentParser, what: str) -> None:
    """--routing and --load-weight, for choosing `what` (e.g. "the decode node")."""
    d = RoutingPolicy()
    parser.add_argument("--routing", choices=ROUTING_MODES, default=d.mode,
                        help=f"how to choose {what}: 'prefix' weighs the prompt tokens each node holds in its "
                        "prefix cache (from its KV events) against its load, 'load' the load alone, "
                        "'round-robin' neither (default %(default)s)")
    parser.add_argument("--load-weight", type=float, default=d.load_weight, metavar="TOKENS",
                        help="routing cost of one request running or queued on a node, in prompt tokens to "
                        "compute: higher spreads load, lower follows the cache (default %(default)s)")


class NodeChooser:
    def __init__(self, policy: RoutingPolicy, index: KvIndex | None) -> None:
        self.policy = policy
        self.index = index
        self._turn = itertools.count()
        self._lock = threading.Lock()

    def rank(self, members: Sequence[Member], token_ids: Sequence[int]) -> list[Choice]:
        """`members` best first for a request that needs `token_ids` computed (or cached)."""
        if not members:
            return []
        if self.policy.mode == "round-robin":
            with self._lock:
                start = next(self._turn) % len(members)
            ordered = sorted(members, key=lambda m: m.address)
            return [Choice(m, 0, 0.0) for m in ordered[start:] + ordered[:start]]
        cached = {m.address: 0 for m in members}
        if self.policy.mode == "prefix" and self.index is not None:
            cached = self.index.cached_tokens([m.address for m in members], token_ids)
        choices = [Choice(m, cached[m.address], self._cost(m, len(token_ids) - cached[m.address])) for m in members]
        return sorted(choices, key=lambda c: (c.cost, c.member.routed, c.member.address))

    def note_routed(self, member: Member, token_ids: Sequence[int]) -> None:
        """The request went to `member`: the tie-breaker and the prediction of its cache."""
        member.routed += 1
        if self.policy.mode == "prefix" and self.index is not None:
            self.index.note_routed(member.address, token_ids)

    def _cost(self, member: Member, uncached: int) -> float:
        return uncached + member.load.queued_prefill_tokens + self.policy.load_weight * member.active_requests
