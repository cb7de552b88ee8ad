"""Running the model over sequences whose K/V live in the paged pool: the engine, the engine loop
and the decode node's continuous-batching scheduler, sampling, guided decoding, sliding windows,
speculative decoding. May import common.model, common.kv, common.tracing and protobuf message
types (protos duet_pb2); never gRPC (grpc, duet_pb2_grpc)."""
