"""What a failed call to another node says: the one classification of gRPC statuses that the
prefill pool, the router and live migration act on.

- `STREAM_BROKEN`: the node, or the way to it, may be gone. UNAVAILABLE is what a killed node's
  client sees ("Stream removed (Socket closed)"); INTERNAL and UNKNOWN are how a stream reset
  (RST_STREAM, a proxy dropping it) can read, and may also be the node's own verdict, which a
  caller that can ask the node again should check (the router's `_node_gone`).
- `STALLED`: the node did not answer in time or the call was cut on our side: for a peer we wait
  on mid-stream (a migration target), as good as gone.
- `REQUEST_FAULT`: the request itself is refused, so another node would refuse it too: retrying it
  elsewhere is pointless (the prefill pool computes it locally instead).
"""
from __future__ import annotations

import grpc

StatusCode = grpc.StatusCode

STREAM_BROKEN = frozenset({StatusCode.UNAVAILABLE, StatusCode.INTERNAL, StatusCode.UNKNOWN})
STALLED = frozenset({StatusCode.DEADLINE_EXCEEDED, StatusCode.CANCELLED})
REQUEST_FAULT = frozenset({StatusCode.INVALID_ARGUMENT, StatusCode.NOT_FOUND, StatusCode.PERMISSION_DENIED,
                           StatusCode.FAILED_PRECONDITION, StatusCode.DEADLINE_EXCEEDED})
