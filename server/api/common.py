"""Pieces every generation endpoint shares: context checks, disconnect watching, SSE framing."""

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import msgspec
from fastapi import Request

from xinserve.server.api.sse import SSEResponse
from xinserve.server.errors import APIError, error_body

logger = logging.getLogger("xinserve.server")

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def new_request_id(prefix: str) -> str:
    """A fresh id for the response and the engine. Never the client's ``X-Request-Id``: two
    requests may send the same one, and the engine needs each id to be unique (the header is for
    logs and the response header)."""
    return f"{prefix}-{uuid.uuid4().hex}"


_encode_json = msgspec.json.Encoder().encode


def dumps(obj: Any) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


def max_tokens_for(
    prompt_tokens: int, requested: int | None, max_model_len: int, *, prompt_param: str, param: str
) -> int:
    """The generation budget; a 400 when the prompt plus ``requested`` exceeds the context.

    ``prompt_param`` ("messages" or "prompt") is blamed when the prompt alone fills the context,
    ``param`` (the max-tokens field the client used) when the sum does.
    """
    if prompt_tokens >= max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt has "
            f"{prompt_tokens} tokens, leaving no room for a completion.",
            param=prompt_param,
            code="context_length_exceeded",
        )
    if requested is None:
        return max_model_len - prompt_tokens
    if prompt_tokens + requested > max_model_len:
        raise APIError(
            400,
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} for the "
            f"completion). Please reduce the prompt or the completion length.",
            param=param,
            code="context_length_exceeded",
        )
    return requested


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def run_until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first; then cancel it and raise ClientDisconnected."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task in done:
        return task.result()
    task.cancel()
    raise ClientDisconnected()


def log_fields(request: Request, gen: Any, status: str) -> None:
    """Fill in the fields of the request's log line (written by the request-log middleware).

    ``gen``: a ``GenerationGroup`` or a ``PoolingRun`` (its request id, worker, adapter and token counts).
    """
    fields = {"id": gen.request_id, "model": gen.worker.model_name, "worker": gen.worker.label}
    lora = gen.lora_name
    if lora is not None:  # the LoRA adapter it ran with, for the line and the per-adapter counters
        fields["lora"] = lora
    request.state.log = {**fields, "prompt_tokens": gen.prompt_tokens, "completion_tokens": gen.completion_tokens,
                         "outcome": status}


def sse_frame(obj: Any) -> bytes:
    """One ``data: {json}`` event, framed here: compact JSON never contains a raw line break.

    msgspec writes the same compact UTF-8 JSON as ``dumps`` several times faster (a frame per token
    per stream), and a non-finite float (a log-prob of -inf) as ``null``, where ``json`` wrote
    ``-Infinity``, which is not JSON. Bytes are a frame already (``server/api/openai/chat_frames.py``)."""
    if type(obj) is bytes:
        return obj
    return b"data: " + _encode_json(obj) + b"\n\n"


def event_stream(
    request: Request, gen: Any, items: AsyncIterator[dict[str, Any] | list[dict[str, Any]]], metrics: Any, *,
    frame: Callable[[dict[str, Any]], bytes],
    error_body: Callable[[APIError], dict[str, Any] | list[dict[str, Any]]], last: bytes = b"",
) -> SSEResponse:
    """Stream ``items``, each framed by ``frame``, then ``last`` (if any) once they end. An item that
    is a list of frames (several chunks ready at once) goes out as one write.

    ``gen``: a ``GenerationGroup`` (``request_id``, ``abort()``, ``observe(metrics, end)``).

    An error after the first frame is sent as ``error_body``'s frame (the API's envelope), or its
    frames in one write (the Responses API's ``error`` and ``response.failed`` events).
    A disconnect cancels the generator; its ``finally`` aborts the request in the worker, writes
    the request's log fields and observes its metrics, however the stream ends.
    """

    def frames(item: dict[str, Any] | list[dict[str, Any]]) -> bytes:
        # A list is a burst of frames ready together: one write (one ASGI message, one send).
        return b"".join(map(frame, item)) if isinstance(item, list) else frame(item)

    async def events() -> AsyncIterator[bytes]:
        status = "disconnected"
        try:
            async for item in items:
                # inline, not ``frames(item)``: a call less per token per stream
                yield b"".join(map(frame, item)) if isinstance(item, list) else frame(item)
            status = "ok"
        except APIError as exc:
            status = f"error {exc.status}"
            yield frames(error_body(exc))
        except Exception:
            status = "error 500"
            logger.exception("request %s failed mid-stream", gen.request_id)
            yield frames(error_body(APIError(500, f"Internal error in request {gen.request_id}.")))
        finally:
            gen.abort()
            log_fields(request, gen, status)
            gen.observe(metrics, time.perf_counter())
        if last:
            yield last

    return SSEResponse(events())


def sse_response(
    request: Request, gen: Any, frames: AsyncIterator[dict[str, Any]], metrics: Any
) -> SSEResponse:
    """OpenAI's stream: ``data: {json}`` events ending with ``data: [DONE]`` (after an error frame too)."""
    return event_stream(request, gen, frames, metrics, frame=sse_frame, error_body=error_body,
                        last=b"data: [DONE]\n\n")
