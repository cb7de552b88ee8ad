"""KV data plane: how the prefill node's K/V bytes reach the decode node's reserved slots."""

TRANSPORTS = ("nixl", "tcp")
