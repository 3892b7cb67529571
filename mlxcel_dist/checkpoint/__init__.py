"""A checkpoint from disk or the Hub to a rank's weights: loading, safetensors
reads, conversion, the shard cache and its fetch over TCP, the tokenizer."""
