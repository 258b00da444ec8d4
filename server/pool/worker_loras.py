"""One worker's LoRA adapters as the HTTP process knows them, and its load / unload calls in flight.

The worker answers each ``LoadLora`` / ``UnloadLora`` with one ``LoraDone`` naming the call's number
(server/worker/messages.py) and the adapters it holds afterwards; ``names`` follows those answers (and
the process's ``Ready`` info), so the router sends a request for an adapter only to a worker that has it.
A call whose process dies or stops before it answers ends with an "unavailable" error.
"""

import asyncio
import itertools
from collections.abc import Callable

from xinserve.server.worker.messages import LoadLora, LoraDone, RequestError, ToWorker, UnloadLora


class WorkerLoras:
    def __init__(self, post: Callable[[ToWorker], bool], label: str) -> None:
        self._post = post  # WorkerClient._post: False when the worker is not ready to take messages
        self.label = label
        self.names: set[str] = set()  # the adapters the worker process holds
        self._pending: dict[int, asyncio.Future[RequestError | None]] = {}
        self._ops = itertools.count(1)

    async def load(self, name: str, path: str) -> RequestError | None:
        """Load adapter ``name`` from ``path`` on the worker: None once it has, else why not."""
        return await self._call(lambda op: LoadLora(op, name, path))

    async def unload(self, name: str) -> RequestError | None:
        return await self._call(lambda op: UnloadLora(op, name))

    async def _call(self, message: Callable[[int], ToWorker]) -> RequestError | None:
        op = next(self._ops)
        future = asyncio.get_running_loop().create_future()
        self._pending[op] = future
        try:
            if not self._post(message(op)):
                return RequestError(f"worker {self.label} is not accepting requests", unavailable=True)
            return await future
        finally:
            self._pending.pop(op, None)

    def done(self, message: LoraDone) -> None:
        """The worker's answer to call ``message.op``."""
        self.names = set(message.adapters)
        future = self._pending.get(message.op)
        if future is not None and not future.done():
            future.set_result(message.error)

    def started(self, names: list[str]) -> None:
        """A new worker process is ready, holding ``names`` (its spec's ``lora_modules``)."""
        self.names = set(names)

    def fail_pending(self, why: str) -> None:
        """The process is gone: every call still waiting ends with ``why`` (a 503)."""
        self.names = set()
        for future in self._pending.values():
            if not future.done():
                future.set_result(RequestError(why, unavailable=True))
