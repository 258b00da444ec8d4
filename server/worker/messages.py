"""The messages between the HTTP process and an engine worker: msgspec structs, msgpack over ZeroMQ.

Each message is one struct, tagged by its kind and encoded as a positional array (``["out", [...],
stats, {...}]``): at one token per request per step, field names would be most of the bytes. The
engine's own records (``StepOutput``, ``EngineStats``, engines/core/outputs.py) travel as they are. The
worker sends ONE ``Outputs`` message per engine step carrying every request's new tokens, so the
per-token IPC cost shrinks as the batch grows.

State per request lives in the HTTP process (``xinserve.server.pool.fanout``: which choices are done, the load);
the worker keeps only what its engine holds. A request that fails is one ``Failed`` message with one
``RequestError``, whichever side (engine, worker, supervisor) found the failure.
"""

from dataclasses import fields

import msgspec

from xinserve.engines.core.outputs import EngineStats, StepOutput
from xinserve.engines.core.sampling_params import DETOKENIZER_FIELDS, SamplingParams
from xinserve.engines.pooling.params import PoolingParams


class RequestError(msgspec.Struct, array_like=True, frozen=True):
    """Why a request failed: the request's own fault (a 400) or ours (a 500; a 503 when the worker
    is unavailable). ``retryable``: the worker went away without a verdict, it may run elsewhere."""

    message: str
    client_fault: bool = False
    unavailable: bool = False
    retryable: bool = False

    @property
    def status(self) -> int:
        return 400 if self.client_fault else 503 if self.unavailable else 500


# HTTP process -> worker

# The detokenizer's fields (stop strings, special tokens in the text) stay in the HTTP process.
_ENGINE_FIELDS = [f for f in fields(SamplingParams) if f.name not in DETOKENIZER_FIELDS]
# ``SamplingParams``' engine fields as one positional record, typed as the dataclass types them (generated
# from it, so the two never drift): decoding an ``Add`` is the worker's structural check (count and types,
# in msgspec's C code), its values were validated once where the ``SamplingParams`` was made.
EngineSampling = msgspec.defstruct("EngineSampling", [(f.name, f.type) for f in _ENGINE_FIELDS], array_like=True)


class Add(msgspec.Struct, array_like=True, tag="add"):
    """A new request. ``params``: the engine's fields of its ``SamplingParams`` (see ``engine_params``)."""

    request_id: str
    prompt_token_ids: list[int]
    params: EngineSampling


RequestParams = SamplingParams | PoolingParams  # a generation's, or a pooling request's (engines/pooling/)
# ``PoolingParams`` as one positional record, generated from the dataclass as ``EngineSampling`` is.
EnginePooling = msgspec.defstruct("EnginePooling", [(f.name, f.type) for f in fields(PoolingParams)], array_like=True)


class AddPooling(msgspec.Struct, array_like=True, tag="pool"):
    """A new prefill-only request of a pooling engine (engines/pooling/); one ``StepOutput`` with
    ``pooled`` answers it."""

    request_id: str
    prompt_token_ids: list[int]
    params: EnginePooling


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    """Stop requests: (request_id, choice index, or None for every choice); ``emitted``, when given, one
    per target: the choice's output tokens its client got (a stop string ended it), or None."""

    targets: list[tuple[str, int | None]]
    emitted: list[int | None] = []


class Shutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


class LoadLora(msgspec.Struct, array_like=True, tag="load_lora"):
    """Load the LoRA adapter at ``path`` (a PEFT directory) as ``name``, between steps; answered by
    one ``LoraDone`` carrying ``op``."""

    op: int
    name: str
    path: str


class UnloadLora(msgspec.Struct, array_like=True, tag="unload_lora"):
    """Unload adapter ``name`` (its running requests finish with it); answered by one ``LoraDone``."""

    op: int
    name: str


# worker -> HTTP process


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    info: dict


class LoadFailed(msgspec.Struct, array_like=True, tag="failed"):
    """Loading failed; the worker exits."""

    message: str


class Outputs(msgspec.Struct, array_like=True, tag="out"):
    """One engine step: every request's new tokens; stats now and then; each request's queue time
    (seconds from its arrival in the worker to its first step) with its first output."""

    outputs: list[StepOutput]
    stats: EngineStats | None = None
    queue_times: dict[str, float] = {}


class Failed(msgspec.Struct, array_like=True, tag="error"):
    """One request failed (every choice of it); the worker lives on."""

    request_id: str
    error: RequestError


class Stats(msgspec.Struct, array_like=True, tag="stats"):
    """The idle heartbeat; it also proves the worker is alive."""

    stats: EngineStats


class InfoUpdate(msgspec.Struct, array_like=True, tag="info"):
    """Keys of ``Ready.info`` that changed after ready: the decode buckets' states and the kernels as
    the background warm-up compiles and swaps them (engines/worker/warmup.py)."""

    info: dict


class LoraDone(msgspec.Struct, array_like=True, tag="lora_done"):
    """The answer to ``LoadLora`` / ``UnloadLora`` number ``op``: ``error`` None when it was done (the
    engine's refusal of a bad adapter is a client fault), and the adapters the worker holds now."""

    op: int
    error: RequestError | None
    adapters: list[str]


ToWorker = Add | AddPooling | Abort | Shutdown | LoadLora | UnloadLora
FromWorker = Ready | LoadFailed | Outputs | Failed | Stats | InfoUpdate | LoraDone

_encoder = msgspec.msgpack.Encoder()
encode = _encoder.encode
# Integer map keys (``logit_bias``'s token ids) are fine: both ends are our own processes.
_decode_to_worker = msgspec.msgpack.Decoder(ToWorker).decode
decode_from_worker = msgspec.msgpack.Decoder(FromWorker).decode


class MalformedAdd(msgspec.ValidationError):
    """An ``Add`` whose request id reads but whose other fields do not fit their types: that request
    fails (a 400), the worker lives on."""

    def __init__(self, request_id: str, message: str) -> None:
        super().__init__(message)
        self.request_id = request_id


def decode_to_worker(frame: bytes) -> ToWorker:
    """The message of ``frame``; a frame of the wrong shape raises ``msgspec.ValidationError``
    (``MalformedAdd`` when it is an ``Add`` whose request id reads)."""
    try:
        return _decode_to_worker(frame)
    except msgspec.ValidationError as exc:
        raw = msgspec.msgpack.decode(frame)
        if isinstance(raw, list) and len(raw) > 1 and raw[0] in ("add", "pool") and isinstance(raw[1], str):
            raise MalformedAdd(raw[1], f"malformed request fields: {exc}") from None
        raise


def add_request(request_id: str, prompt_token_ids: list[int], params: RequestParams) -> Add | AddPooling:
    """The message that adds a request: a generation (``SamplingParams``) or a pooling one."""
    if isinstance(params, PoolingParams):
        return AddPooling(request_id, prompt_token_ids, EnginePooling(*(getattr(params, f.name) for f in fields(params))))
    return Add(request_id, prompt_token_ids, EngineSampling(*(getattr(params, f.name) for f in _ENGINE_FIELDS)))


def engine_params(message: Add | AddPooling) -> SamplingParams | PoolingParams:
    """The engine's params of an ``Add`` (not validated again: the HTTP edge did) or an ``AddPooling``."""
    if isinstance(message, AddPooling):
        return PoolingParams(**msgspec.structs.asdict(message.params))
    return SamplingParams.trusted(**msgspec.structs.asdict(message.params))
