"""What the engine hands back: per-step deltas (for streaming), finished results (offline) and its
stats. No torch here: the HTTP process receives the same records over IPC (server/messages.py).

The records that cross the process boundary are msgspec structs, encoded as positional arrays in
field order (no field names on the wire).
"""

from dataclasses import dataclass, field

import msgspec


class TokenLogprob(msgspec.Struct, array_like=True):
    """Log-probability of one generated token and its top alternatives (raw model distribution)."""

    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


class StepOutput(msgspec.Struct, array_like=True):
    """New tokens of one sequence from one engine step. ``index`` is the choice index (n > 1)."""

    request_id: str
    index: int
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # why the request failed (finish reason "error")
    # With the first token of a request that asked for them: one entry per prompt token, None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    bad_request: bool = False  # the request's own fault (a schema that failed to compile): a 400, not a 500


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request from ``LLM.generate``; the top-level fields mirror ``outputs[0]``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for, one per prompt token

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason


class EngineStats(msgspec.Struct, array_like=True):
    """A worker's engine counters and gauges, sent with its outputs and read by /metrics and /health."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float  # fraction of KV blocks held by live sequences, 0..1
    num_preemptions_total: int
    prefix_cache_queries_total: int  # prompt tokens looked up
    prefix_cache_hits_total: int  # prompt tokens found in the cache
    prompt_tokens_total: int
    generation_tokens_total: int
    external_prefix_cache_queries_total: int = 0  # prompt tokens looked up in the host KV tier
    external_prefix_cache_hits_total: int = 0  # of those, tokens it held past the pool's own hits
