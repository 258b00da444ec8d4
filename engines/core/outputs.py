"""What the engine hands back: per-step deltas (for streaming), finished results (offline) and its
stats. No torch here: the HTTP process receives the same records over IPC (server/worker/messages.py).

The records that cross the process boundary are msgspec structs, encoded as positional arrays in
field order (no field names on the wire).
"""

from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from xinserve.engines.speculative.stats import SpecDecodeStats

# Why a sequence ended: a stop token, its length budget, or an abort (the client's, a stop string's,
# or the engine's when the request failed: that travels beside the outputs as a ``RequestFailure``).
FinishReason = Literal["stop", "length", "abort"]


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
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None
    # With the first token of a request that asked for them: one entry per prompt token, None first.
    prompt_logprobs: list[TokenLogprob | None] | None = None
    # With the last output of a request whose KV another instance reads (vLLM's field; engines/kv/connector.py).
    kv_transfer_params: dict[str, Any] | None = None
    # A pooling request's one output (engines/pooling/): its embedding, or its label probabilities / score.
    pooled: list[float] | None = None


@dataclass(slots=True)
class RequestFailure:
    """A request the engine ended because it failed (every choice of it is finished, its KV blocks
    freed). ``bad_request``: the request's own fault (a schema that failed to compile), a 400 rather
    than a 500."""

    request_id: str
    message: str
    bad_request: bool = False


@dataclass(slots=True)
class StepResult:
    """What one engine step returns: the sequences' new tokens, and the requests that failed in it."""

    outputs: list[StepOutput] = field(default_factory=list)
    failures: list[RequestFailure] = field(default_factory=list)


@dataclass(slots=True)
class CompletionOutput:
    """One finished choice of a request."""

    index: int
    token_ids: list[int]
    text: str
    finish_reason: FinishReason | None
    logprobs: list[TokenLogprob] | None = None


@dataclass(slots=True)
class RequestOutput:
    """A finished request from ``LLM.generate``; the top-level fields mirror ``outputs[0]``."""

    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for, one per prompt token
    error: str | None = None  # why the request failed (its choices then end with "abort")
    kv_transfer_params: dict[str, Any] | None = None  # what a decode instance needs to read its KV

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason


class SpecDecodeCounters(msgspec.Struct, array_like=True):
    """Speculative decoding's acceptance so far (vLLM's ``spec_decode_*`` counters)."""

    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_position: list[int]  # [k] drafts whose token at position i was accepted

    @property
    def acceptance_rate(self) -> float | None:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None


def spec_decode_stats(method: str, stats: SpecDecodeStats) -> SpecDecodeCounters:
    return SpecDecodeCounters(method, stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens,
                              list(stats.accepted_per_position))


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
    spec_decode: SpecDecodeCounters | None = None  # with speculative decoding on
    external_prefix_cache_queries_total: int = 0  # prompt tokens looked up in the host KV tier
    external_prefix_cache_hits_total: int = 0  # of those, tokens it held past the pool's own hits
    prompt_tokens_computed_total: int = 0  # prompt tokens run through the model: not cached, not loaded
    # Prefill/decode disaggregation (engines/kv/mooncake_connector.py): requests whose blocks a prefill
    # instance holds for their reader, holds ended by a read or by the timeout; a decode instance's failed reads.
    kv_transfer_held_requests: int = 0
    kv_transfer_sent_total: int = 0
    kv_transfer_expired_total: int = 0
    kv_transfer_failed_loads_total: int = 0
    # LoRA (vLLM's lora_requests_info): adapters of running and of waiting requests, and the device slots
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    max_lora: int = 0
