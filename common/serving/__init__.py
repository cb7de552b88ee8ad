"""What makes the engine a daemon: start-up, flags and config, placement, TLS, model loading,
conversions between duet.v1 messages and engine types (and traces), error codes as gRPC statuses,
prompts, the compatibility fingerprint and pool gauges. May import common.engine, common.model,
common.kv, common.transports and the top-level common modules; never a node package, common.peers
or router."""
