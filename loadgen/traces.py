"""--trace: fetch a run's request traces from the target and other nodes, merge, write one file."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import grpc

from common.serving.trace_messages import trace_event_from_proto
from common.tracing import TraceEvent, merge, write_chrome_trace
from protos.duet.v1 import duet_pb2 as pb
from protos.duet.v1 import duet_pb2_grpc

FETCH_TIMEOUT_S = 10.0
MAX_TRACE_BYTES = 256 << 20


@dataclass
class CollectedTrace:
    events: list[TraceEvent] = field(default_factory=list)  # merged, in time order
    events_by_node: dict[str, int] = field(default_factory=dict)  # address -> events it returned
    failures: dict[str, str] = field(default_factory=dict)  # address -> why it returned none


def fetch_trace(address: str, request_ids: list[str], timeout_s: float = FETCH_TIMEOUT_S) -> list[TraceEvent]:
    """GetTrace from a decode or prefill node (both services define it); raises grpc.RpcError."""
    options = [("grpc.max_receive_message_length", MAX_TRACE_BYTES)]
    with grpc.insecure_channel(address, options=options) as channel:
        request = pb.GetTraceRequest(request_ids=request_ids)
        try:
            trace = duet_pb2_grpc.DecodeNodeStub(channel).GetTrace(request, timeout=timeout_s)
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise
            trace = duet_pb2_grpc.PrefillNodeStub(channel).GetTrace(request, timeout=timeout_s)
    return [trace_event_from_proto(e) for e in trace.events]


def collect_trace(addresses: list[str], request_ids: list[str]) -> CollectedTrace:
    """The merged traces of `request_ids` from every address; a node that does not answer is
    recorded in `failures`, not raised."""
    out, groups = CollectedTrace(), []
    for address in dict.fromkeys(addresses):
        try:
            events = fetch_trace(address, request_ids)
        except grpc.RpcError as exc:
            out.failures[address] = f"{exc.code().name}: {exc.details()}"
            continue
        out.events_by_node[address] = len(events)
        groups.append(events)
    out.events = merge(*groups)
    return out


def write_run_trace(path: Path, addresses: list[str], request_ids: list[str]) -> CollectedTrace:
    collected = collect_trace(addresses, request_ids)
    write_chrome_trace(path, collected.events)
    return collected
