"""Wire format between the HTTP process and an engine worker: msgpack frames over ZeroMQ PUSH/PULL.

Each message is one msgpack array whose first element is its kind. The records that cross are the
engine's own dataclasses, one type per message (``SamplingParams`` in, ``StepOutput`` and
``EngineStats`` out), sent as positional arrays in field order and rebuilt on the other side, so a
field added to a record travels without a second definition here. The worker sends ONE ``OUTPUTS``
message per engine step carrying every request's new tokens, so the per-token IPC cost shrinks as
the batch grows (measured by ``benchmarks/ipc_overhead.py``); positional arrays because at one token
per request per step, field names would be most of the bytes.
"""

from dataclasses import fields
from typing import Any

import msgpack

from engines.outputs import EngineStats, StepOutput, TokenLogprob
from engines.sampling_params import SamplingParams

# HTTP process -> worker
ADD = "add"  # [ADD, request_id, prompt_token_ids, sampling params]
ABORT = "abort"  # [ABORT, [[request_id, choice_index | None], ...]]   None: every choice
SHUTDOWN = "shutdown"  # [SHUTDOWN]

# worker -> HTTP process
READY = "ready"  # [READY, info]
FAILED = "failed"  # [FAILED, message]   loading failed; the worker exits
OUTPUTS = "out"  # [OUTPUTS, [output, ...], stats | None, {request_id: queue_seconds}]
ERROR = "error"  # [ERROR, request_id, http_status, message]   one request failed; the worker lives on
STATS = "stats"  # [STATS, stats]   idle heartbeat, also proves the worker is alive

_PARAM_FIELDS = tuple(f.name for f in fields(SamplingParams))
_STATS_FIELDS = tuple(f.name for f in fields(EngineStats))


def pack(message: list[Any]) -> bytes:
    return msgpack.packb(message, use_bin_type=True)


def unpack(frame: bytes) -> list[Any]:
    # Integer map keys (``logit_bias``'s token ids) are allowed: both ends are our own processes.
    return msgpack.unpackb(frame, raw=False, use_list=True, strict_map_key=False)


def encode_params(params: SamplingParams) -> list[Any]:
    return [getattr(params, name) for name in _PARAM_FIELDS]


def decode_params(values: list[Any]) -> SamplingParams:
    """Rebuilt (and so validated again) in the worker; raises ValueError on a bad value."""
    return SamplingParams(*values)


def _encode_logprob(lp: TokenLogprob | None) -> list[Any] | None:
    return None if lp is None else [lp.logprob, lp.top_token_ids, lp.top_logprobs]


def _decode_logprob(entry: list[Any] | None) -> TokenLogprob | None:
    return None if entry is None else TokenLogprob(*entry)


def encode_step_output(out: StepOutput) -> list[Any]:
    logprobs = prompt_logprobs = None
    if out.logprobs is not None:
        logprobs = [_encode_logprob(lp) for lp in out.logprobs]
    if out.prompt_logprobs is not None:
        prompt_logprobs = [_encode_logprob(lp) for lp in out.prompt_logprobs]
    return [out.request_id, out.index, out.new_token_ids, out.finished, out.finish_reason, logprobs, out.error,
            prompt_logprobs]


def decode_output(item: list[Any]) -> StepOutput:
    request_id, index, token_ids, finished, reason, logprobs, error, prompt_logprobs = item
    if logprobs is not None:
        logprobs = [_decode_logprob(entry) for entry in logprobs]
    if prompt_logprobs is not None:
        prompt_logprobs = [_decode_logprob(entry) for entry in prompt_logprobs]
    return StepOutput(request_id, index, token_ids, finished, reason, logprobs, error, prompt_logprobs)


def encode_stats(stats: EngineStats) -> list[Any]:
    return [getattr(stats, name) for name in _STATS_FIELDS]


def decode_stats(values: list[Any]) -> EngineStats:
    return EngineStats(*values)
