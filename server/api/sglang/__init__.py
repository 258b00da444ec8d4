"""The worker endpoints SGLang's model gateway (sglang-router) probes."""
