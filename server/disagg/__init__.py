"""Prefill/decode disaggregation at the HTTP edge: vLLM's ``kv_transfer_params`` in responses, and a small
proxy that speaks vLLM's disaggregation protocol to a prefill and a decode instance (docs/disaggregation.md)."""
