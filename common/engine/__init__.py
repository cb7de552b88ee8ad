"""Running the model over sequences whose K/V live in the paged pool: the engine, the engine loop
and the decode node's continuous-batching scheduler, sampling, guided decoding, sliding windows,
speculative decoding. May import common.model, common.kv, common.errors and common.tracing; never
gRPC or the duet.v1 messages (tests/unit/test_import_layers.py)."""
