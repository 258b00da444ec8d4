"""vLLM's ``kv_transfer_params`` in a response body: what a prefill instance tells the proxy, which passes
it to the decode instance (docs/disaggregation.md). Present only when the engine handed the request's KV
over; a streamed answer does not carry it (the proxies call the prefill instance without streaming)."""

from typing import Any


def with_transfer_params(body: dict[str, Any], gen: Any) -> dict[str, Any]:
    """``body`` with the generation's ``kv_transfer_params`` beside its choices, when it has some."""
    if gen.kv_transfer_params is not None:
        body["kv_transfer_params"] = gen.kv_transfer_params
    return body
