"""One request in flight: worker outputs -> detokenised per-choice text deltas, stop strings, abort.

Detokenisation runs here, in the HTTP process (DESIGN.md): the worker only ships token ids. Stop
strings are matched here too (as in vLLM v1); when every choice has stopped this way the request
is aborted in the worker so its KV blocks are freed at once.

A request whose worker dies before it produced any token is started once more on another worker
(``retry``, ``Router.replacement``): the client has seen nothing, so nothing is repeated. After a
token the death is an error: a 503, or an error frame when streaming.
"""

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from xinserve.engines.core.detokenizer import IncrementalDetokenizer
from xinserve.engines.core.outputs import FinishReason, StepOutput, TokenLogprob
from xinserve.engines.core.sampling_params import SamplingParams
from xinserve.server.api.stream_queue import ItemQueue
from xinserve.server.errors import APIError
from xinserve.server.pool.fanout import RequestStream
from xinserve.server.pool.worker_client import WorkerClient
from xinserve.server.worker.messages import RequestError

logger = logging.getLogger("xinserve.server")

_TIMEOUT = object()  # queue sentinel put by the request deadline


@dataclass(slots=True)
class Delta:
    """What one choice gained from one batch of worker outputs."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None
    finish_reason: FinishReason | None


@dataclass(slots=True)
class Choice:
    detokenizer: Any
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None
    finish_reason: FinishReason | None = None


class Generation:
    def __init__(
        self,
        worker: WorkerClient,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        tokenizer: Any,
        *,
        timeout_s: float = 600.0,
        retry: Callable[[int], Awaitable[WorkerClient | None]] | None = None,
    ) -> None:
        """``retry(n)`` finds another worker for ``n`` sequences when this one dies (None: no retry)."""
        self.worker = worker
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.timeout_s = timeout_s
        self.choices = [
            Choice(IncrementalDetokenizer(
                tokenizer, prompt_token_ids, params.stop, params.skip_special_tokens,
                min_tokens=params.min_tokens, include_stop_str_in_output=params.include_stop_str_in_output,
            ))
            for _ in range(params.n)
        ]
        self._unfinished = params.n  # choices without a finish reason (``done`` is read several times a token)
        self.prompt_logprobs: list[TokenLogprob | None] | None = None  # when asked for (echo with logprobs)
        self.kv_transfer_params: dict[str, Any] | None = None  # a prefill's answer to the decode instance
        self.arrival = time.perf_counter()
        self.first_token_at: float | None = None
        self.last_token_at: float | None = None
        self.inter_token_latencies: list[float] = []
        self._stream: RequestStream | None = None
        self._deadline: asyncio.TimerHandle | None = None
        self._open = False  # the worker still holds the request
        self._retry = retry

    @property
    def done(self) -> bool:
        return self._unfinished == 0

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def completion_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.choices)

    @property
    def queue(self) -> ItemQueue | None:
        """The current stream's queue (a retry replaces it)."""
        return self._stream.queue if self._stream else None

    @property
    def queue_time(self) -> float | None:
        return self._stream.queue_time if self._stream else None

    def start(self) -> None:
        self._add()
        self._deadline = asyncio.get_running_loop().call_later(self.timeout_s, self._expire)

    def _add(self) -> None:
        self._stream = self.worker.add(self.request_id, self.prompt_token_ids, self.params)
        self._open = True

    def _expire(self) -> None:
        assert self._stream is not None
        self._stream.queue.put_nowait(_TIMEOUT)  # the current stream's: a retry replaces it

    def abort(self) -> None:
        """Free the request in its worker (safe to call twice, and from a cancelled task)."""
        if self._deadline is not None:
            self._deadline.cancel()
        if self._open:
            self._open = False
            self.worker.abort(self.request_id)

    async def next_deltas(self) -> list[Delta]:
        """Wait for the next outputs and return what each choice gained; [] once all are done.

        Everything already queued is taken at once, so a consumer that fell behind sends fewer,
        larger frames instead of lagging further.
        """
        if not self._unfinished or self._stream is None:
            return []
        queue = self._stream.queue
        items = [await queue.get()]
        while not queue.empty():
            items.append(queue.get_nowait())
        if isinstance(items[0], RequestError) and self._may_retry(items):
            await self._start_elsewhere(items[0])
            return await self.next_deltas()
        return self.take(items)

    def take(self, items: list[object]) -> list[Delta]:
        """What each choice gained from ``items`` (the stream's next items, in order), by choice index."""
        by_index: dict[int, Delta] = {}
        for item in items:
            self._apply(item, by_index)
        if by_index:
            now = time.perf_counter()
            if self.first_token_at is None:
                self.first_token_at = now
            elif self.last_token_at is not None:
                self.inter_token_latencies.append(now - self.last_token_at)
            self.last_token_at = now
        if not self._unfinished:
            self.abort()  # a no-op unless a stop string finished it before the engine did
        if len(by_index) == 1:
            return list(by_index.values())
        return sorted(by_index.values(), key=lambda d: d.index)

    def _may_retry(self, items: list[object]) -> bool:
        """Once, when the worker went away before this request produced any token."""
        error = items[0]
        return (
            len(items) == 1 and isinstance(error, RequestError) and error.retryable
            and self._retry is not None and self.completion_tokens == 0
        )

    async def _start_elsewhere(self, error: RequestError) -> None:
        assert self._retry is not None and self._deadline is not None
        self._open = False
        retry, self._retry = self._retry, None
        worker = await retry(len(self.choices))
        if worker is None:
            raise APIError(503, f"{error.message}; no other worker of {self.worker.model_name} became ready.")
        logger.warning("request %s: %s; retrying on %s", self.request_id, error.message, worker.label)
        self.worker = worker
        self._add()
        if asyncio.get_running_loop().time() >= self._deadline.when():
            # The deadline passed while waiting for a worker: it fired into the old stream, or is due.
            self._deadline.cancel()
            self._expire()

    def _apply(self, item: object, by_index: dict[int, Delta]) -> None:
        if item is _TIMEOUT:
            self.abort()
            raise APIError(504, f"The request timed out after {self.timeout_s:g}s.", code="timeout")
        if isinstance(item, RequestError):
            self._open = False
            raise APIError(item.status, item.message)
        assert isinstance(item, StepOutput)
        if item.prompt_logprobs is not None:
            self.prompt_logprobs = item.prompt_logprobs
        if item.kv_transfer_params is not None:
            self.kv_transfer_params = item.kv_transfer_params
        choice = self.choices[item.index]
        if choice.finish_reason is not None:
            return  # stopped by a stop string; the worker's abort is in flight
        delta = by_index.get(item.index)
        if delta is None:
            delta = by_index[item.index] = Delta(item.index, "", [], None, None)
        # The engine's own "stop" is always a stop token (EOS or stop_token_ids): its text is left out.
        ends_with_stop_token = item.finished and item.finish_reason == "stop"
        # A stop string ends the output at its token, even inside a speculative step's accepted drafts.
        text, stopped, kept = choice.detokenizer.add_each(item.new_token_ids, ends_with_stop_token)
        choice.token_ids.extend(item.new_token_ids[:kept])
        delta.token_ids.extend(item.new_token_ids[:kept])
        if item.logprobs is not None:
            if choice.logprobs is None:
                choice.logprobs = []
            if delta.logprobs is None:
                delta.logprobs = []
            choice.logprobs.extend(item.logprobs[:kept])
            delta.logprobs.extend(item.logprobs[:kept])
        if stopped:
            choice.finish_reason = "stop"
            self._unfinished -= 1
            if not item.finished:
                # Free this choice's KV blocks now (others may go on), saying how many of its tokens were
                # emitted: the engine's generation_tokens_total drops the ones past the stop string.
                self.worker.abort_choice(self.request_id, item.index, len(choice.token_ids))
        elif item.finished:
            if item.finish_reason not in ("stop", "length"):
                self.abort()
                raise APIError(500, f"The engine ended the request unexpectedly ({item.finish_reason}).")
            choice.finish_reason = item.finish_reason
            self._unfinished -= 1
            text += choice.detokenizer.flush()  # held back as a possible stop-string start; final now
        choice.text += text
        delta.text += text
        delta.finish_reason = choice.finish_reason
