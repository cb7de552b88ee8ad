"""Engine pieces shared by the decode and prefill nodes: model, paged KV cache, prefix cache,
transports and configuration."""
