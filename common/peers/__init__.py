"""Clients of other nodes: a health-checked, load-aware set of nodes of one kind (membership), the
prefill-node client built on it (prefill_pool), the index of the nodes' cached blocks fed by their
KV events (kv_index, kv_watch) and the ranking of nodes by cache and load (routing), shared by the
decode node and the router. May import gRPC, protos, common.serving (TLS) and
common.kv.block_hashes (the block names); never the engine, the model or the KV cache itself."""
