"""uvicorn's server with a drain before it stops, so SIGTERM and Ctrl-C no longer cut streams.

On a signal uvicorn sets ``should_exit`` at once and, after its grace period, cancels every stream
still open mid-response (uvicorn then logs "ASGI callable returned without completing response").
Here the first signal starts ``Drain.run`` and ``should_exit`` is set only when it is over, so uvicorn
finds nothing left to cut. A second signal ends the remaining requests at once.
The signal is not raised again after shutdown as uvicorn does (to die by the default handler):
a drained server exits 0.
"""

import asyncio
import logging
import signal
import socket
from types import FrameType

import uvicorn

from xinserve.server.http.drain import Drain

logger = logging.getLogger("xinserve.server")


class GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, drain: Drain, timeout_s: float) -> None:
        super().__init__(config)
        self.drain = drain
        self.timeout_s = timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None  # set before uvicorn installs handle_exit
        self._draining: asyncio.Task | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # A signal handler runs between two bytecodes of whatever the loop was doing: only schedule.
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._on_signal, sig)

    def _on_signal(self, sig: int) -> None:
        if self._draining is None:
            logger.info("%s received: stopping", signal.Signals(sig).name)
            self._draining = asyncio.ensure_future(self._drain())
        else:
            self.drain.hurry()

    async def _drain(self) -> None:
        try:
            await self.drain.run(self.timeout_s)
        finally:
            self.should_exit = True
