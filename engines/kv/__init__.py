"""KV cache beyond the device pool: vLLM's KV events and their publisher, and the host KV tier (a KV connector)."""
