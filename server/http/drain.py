"""Graceful shutdown's state: requests in flight, the draining flag, and the drain itself.

While draining, new requests get a 503 in OpenAI's envelope (and ``Connection: close``, so the
client's next attempt goes to another replica) and ``/health`` says "draining"; the running ones,
streams included, get up to ``server.shutdown_timeout_s`` to finish. What is left then is ended
through the workers' request streams, so each handler finishes its own response: a stream with an
error frame and ``data: [DONE]``, a request still waiting for its answer with a 503. Probes and
scrapes are neither counted nor refused.
"""

import asyncio
import logging
from collections.abc import Iterable
from typing import Any

from xinserve.server.errors import APIError, error_response
from xinserve.server.pool.model_pool import ModelPool

logger = logging.getLogger("xinserve.server")

PROBE_PATHS = ("/health", "/health/live", "/metrics")
# How long the ended requests' handlers get to write their error frame and [DONE].
END_GRACE_S = 5.0
SHUTTING_DOWN = "The server is shutting down; retry the request on another replica."


class Drain:
    def __init__(self, pools: Iterable[ModelPool]) -> None:
        self.pools = list(pools)
        self.draining = False
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._hurry = asyncio.Event()

    def enter(self) -> None:
        self.in_flight += 1
        self._idle.clear()

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0:
            self._idle.set()

    def hurry(self) -> None:
        """Stop waiting for the running requests: end them now (a second SIGTERM or Ctrl-C)."""
        self._hurry.set()

    async def run(self, timeout_s: float) -> None:
        """Refuse new requests, wait up to ``timeout_s`` for the running ones, then end the rest."""
        self.draining = True
        logger.info("draining: %d request(s) in flight get up to %gs to finish", self.in_flight, timeout_s)
        waits = [asyncio.ensure_future(self._idle.wait()), asyncio.ensure_future(self._hurry.wait())]
        await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
        for task in waits:
            task.cancel()
        if self._idle.is_set():
            return
        logger.warning("ending %d request(s) still running", self.in_flight)
        for pool in self.pools:
            for worker in pool.workers:
                worker.end_requests(SHUTTING_DOWN)
        try:
            await asyncio.wait_for(self._idle.wait(), END_GRACE_S)
        except TimeoutError:
            logger.error("%d request(s) did not end; the server stops anyway", self.in_flight)


class DrainMiddleware:
    """Counts each request until its last byte is sent (streams included); 503 for new ones while draining."""

    def __init__(self, app: Any, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] in PROBE_PATHS:
            await self.app(scope, receive, send)
            return
        if self.drain.draining:
            refusal = error_response(APIError(503, SHUTTING_DOWN, code="shutting_down"), {"Connection": "close"})
            await refusal(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()
