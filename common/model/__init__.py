"""The Llama-family model and what it is made from: config, checkpoint loaders (GGUF, Hugging
Face), packed linear layers, paged attention, tokenizer, detokenizer and the embedded default model.
May import common.kv (the model reads and writes K/V through a KVPool) and cpu/; never gRPC."""
