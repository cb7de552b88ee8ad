"""The paged KV cache: the pool tensor, the page allocator, the radix prefix cache and the
page-segment metadata of PrepareReceive. Imports nothing else from common: never the model,
the engine or gRPC."""
