"""The one handler path both generation endpoints share; chat is the one-prompt case of completions.

validate and build the generations (the endpoint) -> start them all -> wait for every prompt's first
tokens, so that an error still gets a real HTTP status -> stream, or collect the whole answer ->
abort in the workers on a disconnect or an error -> one log line and one metrics observation. The
log line's fields (which the per-key usage counts from) are left whatever the outcome, once routed.
The endpoints only say how a response body or a stream frame looks.
"""

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from xinserve.server.api.common import ClientDisconnected, log_fields, run_until_disconnect, sse_response
from xinserve.server.api.generation import Delta, Generation
from xinserve.server.api.sse import SSEResponse
from xinserve.server.api.stream_push import PushFrames, StreamPush
from xinserve.server.errors import APIError
from xinserve.server.pool.worker_client import WorkerClient


class GenerationGroup:
    """The generations of one HTTP request, one per prompt, seen as one for logs and metrics."""

    def __init__(self, request_id: str, gens: list[Generation]) -> None:
        self.request_id = request_id
        self.gens = gens

    @property
    def worker(self) -> WorkerClient:
        return self.gens[0].worker  # read late: a retry may have moved it

    @property
    def lora_name(self) -> str | None:
        return self.gens[0].params.lora_name  # the LoRA adapter it runs with (None: the base model)

    @property
    def prompt_tokens(self) -> int:
        return sum(g.prompt_tokens for g in self.gens)

    @property
    def completion_tokens(self) -> int:
        return sum(g.completion_tokens for g in self.gens)

    def start(self) -> None:
        for g in self.gens:
            g.start()

    def abort(self) -> None:
        for g in self.gens:
            g.abort()

    def observe(self, metrics: Any, end: float) -> None:
        for g in self.gens:
            metrics.observe(g, end)

    async def first_deltas(self) -> list[list[Delta]]:
        return list(await asyncio.gather(*(g.next_deltas() for g in self.gens)))

    async def merged(self) -> AsyncIterator[tuple[int, list[Delta]]]:
        """Deltas of every generation as they come, tagged with the generation's position."""
        gens = self.gens
        if len(gens) == 1:
            # One prompt (every chat request): await it directly. A task and an ``asyncio.wait`` per
            # step per stream were a measured share of the HTTP process's per-token time.
            (gen,) = gens
            while not gen.done:
                yield 0, await gen.next_deltas()
            return
        pending = {asyncio.ensure_future(g.next_deltas()): i for i, g in enumerate(gens) if not g.done}
        try:
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    i = pending.pop(task)
                    yield i, task.result()
                    if not gens[i].done:
                        pending[asyncio.ensure_future(gens[i].next_deltas())] = i
        finally:
            for task in pending:
                task.cancel()

    async def collect(self) -> None:
        async for _ in self.merged():
            pass


def _outcome(exc: BaseException) -> str:
    """The log line's outcome of a request that ended with ``exc``: its HTTP status when it has one."""
    if isinstance(exc, APIError):
        return f"error {exc.status}"
    return "error 500" if isinstance(exc, Exception) else "cancelled"


# a view's stream: chunks, or lists of chunks ready together (each list is one write)
Frames = Callable[[GenerationGroup, list[list[Delta]]], AsyncIterator[dict[str, Any] | list[dict[str, Any]]]]
Body = Callable[[GenerationGroup], dict[str, Any]]


async def respond(
    request: Request, group: GenerationGroup, stream: bool, frames: Frames, body: Body,
    stream_response: Callable[..., Response] = sse_response, push: PushFrames | None = None,
) -> Response:
    """Run the group and answer: ``frames(group, first deltas)`` as SSE, or ``body(group)`` as JSON.

    ``stream_response(request, group, frames, metrics)`` frames the stream: OpenAI's ``data:`` lines
    by default (``sse_response``); Anthropic's ``event:`` lines are ``server/api/anthropic/sse.py``'s.
    ``push(deltas)``: the encoded frames the stream would send for ``deltas``, for a ``StreamPush``."""
    metrics = request.app.state.metrics
    group.start()
    try:
        firsts = await run_until_disconnect(request, group.first_deltas())
        if stream:
            response = stream_response(request, group, frames(group, firsts), metrics)
            if push is not None and isinstance(response, SSEResponse):
                response.push = StreamPush.for_gens(group.gens, push)
            return response
        await run_until_disconnect(request, group.collect())
    except ClientDisconnected:
        group.abort()
        log_fields(request, group, "disconnected")
        return Response(status_code=499)
    except BaseException as exc:
        # Routed and started: the log line and the key's usage still count what was consumed.
        group.abort()
        log_fields(request, group, _outcome(exc))
        raise
    log_fields(request, group, "ok")
    group.observe(metrics, time.perf_counter())
    return JSONResponse(body(group))
