"""Request traces (common/tracing.py) as duet.v1 messages: GetTrace's answer, and its events
read back by a client (loadgen, scripts)."""
from __future__ import annotations

import json
from collections.abc import Iterable

from common.tracing import TraceEvent
from protos.duet.v1 import duet_pb2 as pb


def trace_to_proto(events: Iterable[TraceEvent]) -> pb.Trace:
    return pb.Trace(events=[pb.TraceEvent(request_id=e.request_id, name=e.name, node=e.node,
                                          start_unix=e.start_unix, duration_s=e.duration_s,
                                          args_json=json.dumps(e.args, default=str)) for e in events])


def trace_event_from_proto(e: pb.TraceEvent) -> TraceEvent:
    try:
        args = json.loads(e.args_json) if e.args_json else {}
    except json.JSONDecodeError:
        args = {"args_json": e.args_json}
    return TraceEvent(e.request_id, e.name, e.node, e.start_unix, e.duration_s, args if isinstance(args, dict) else {})
