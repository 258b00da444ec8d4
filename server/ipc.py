"""Wire format between the HTTP process and an engine worker: msgpack frames over ZeroMQ PUSH/PULL.

Each message is one msgpack array whose first element is its kind. The worker sends ONE
``OUTPUTS`` message per engine step carrying every request's new tokens, so the per-token IPC cost
shrinks as the batch grows (measured by ``benchmarks/ipc_overhead.py``). Outputs travel as
positional arrays rather than maps: at one token per request per step, field names would be most
of the bytes.
"""

from dataclasses import dataclass
from typing import Any

import msgpack

# HTTP process -> worker
ADD = "add"  # [ADD, request_id, prompt_token_ids, sampling_kwargs]
ABORT = "abort"  # [ABORT, [[request_id, choice_index | None], ...]]   None: every choice
SHUTDOWN = "shutdown"  # [SHUTDOWN]

# worker -> HTTP process
READY = "ready"  # [READY, info]
FAILED = "failed"  # [FAILED, message]   loading failed; the worker exits
OUTPUTS = "out"  # [OUTPUTS, [output, ...], stats | None, {request_id: queue_seconds}]
ERROR = "error"  # [ERROR, request_id, http_status, message]   one request failed; the worker lives on
STATS = "stats"  # [STATS, stats]   idle heartbeat, also proves the worker is alive

STATS_FIELDS = (
    "num_running",
    "num_waiting",
    "kv_cache_usage",
    "num_preemptions_total",
    "prefix_cache_queries_total",
    "prefix_cache_hits_total",
    "prompt_tokens_total",
    "generation_tokens_total",
)


@dataclass(slots=True)
class TokenOutput:
    """New tokens of one choice from one step, as the HTTP process sees them."""

    request_id: str
    index: int
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    # Per token: (logprob, top token ids, top logprobs).
    logprobs: list[tuple[float, list[int], list[float]]] | None


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list[Any]:
    return msgpack.unpackb(frame, raw=False, use_list=True)


def encode_step_output(out: Any) -> list[Any]:
    """An ``engines.outputs.StepOutput`` as a positional array."""
    logprobs = None
    if out.logprobs is not None:
        logprobs = [[lp.logprob, lp.top_token_ids, lp.top_logprobs] for lp in out.logprobs]
    return [out.request_id, out.index, out.new_token_ids, out.finished, out.finish_reason, logprobs]


def decode_output(item: list[Any]) -> TokenOutput:
    request_id, index, token_ids, finished, reason, logprobs = item
    return TokenOutput(request_id, index, token_ids, finished, reason, logprobs)


def encode_stats(stats: Any) -> list[Any]:
    """An ``EngineStats`` as a positional array in ``STATS_FIELDS`` order."""
    return [getattr(stats, name) for name in STATS_FIELDS]


def decode_stats(values: list[Any]) -> dict[str, float]:
    return dict(zip(STATS_FIELDS, values, strict=True))
