"""Clients of other nodes: a health-checked, load-aware set of nodes of one kind (membership) and
the prefill-node client built on it (prefill_pool), shared by the decode node and the router.
May import gRPC, protos and common.serving (TLS); never the engine, the model or the KV cache."""
