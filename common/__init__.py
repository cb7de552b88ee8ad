"""What the decode node, the prefill node and the router share, one package per concept: kv, model,
engine, transports, serving, peers, openai_http (docs/architecture.md draws the arrows allowed
between them), plus modules every layer may import: errors, tracing, daemon_limits, and kernel_library
(the build-once helper of cpu/ and cuda/)."""
