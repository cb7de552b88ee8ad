"""The RPCs every node answers alike (GetLoad, GetTrace, WatchKvEvents), mixed into the decode
and prefill nodes' servicers."""
from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from common.serving.kv_event_stream import KvEventStreams
from common.serving.rpc_convert import to_proto
from common.serving.trace_messages import trace_to_proto
from protos.duet.v1 import duet_pb2 as pb


class NodeRpcs:
    """`node` has `load()`, `tracer` and `engine` (whose KV events WatchKvEvents streams)."""

    def __init__(self, node: Any, draining: threading.Event | None = None) -> None:
        self.node = node
        self.kv_events = KvEventStreams(node.engine.kv_events, draining or threading.Event())

    def GetLoad(self, request: pb.GetLoadRequest, context) -> pb.NodeLoad:
        return to_proto(self.node.load(), pb.NodeLoad)

    def GetTrace(self, request: pb.GetTraceRequest, context) -> pb.Trace:
        return trace_to_proto(self.node.tracer.events(request.request_ids))

    def WatchKvEvents(self, request: pb.WatchKvEventsRequest, context) -> Iterator[pb.KvEvent]:
        yield from self.kv_events.watch(request, context)
