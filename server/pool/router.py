"""Model name -> worker: the least-loaded ready worker of the model, else of its fallback chain.

A request's ``model`` may also name a LoRA adapter of a served model (server/lora/): ``resolve`` is the
one place a name becomes a ``Target`` (the base model, the adapter). An adapter's requests go only to its
base model's workers that hold it, never to a fallback (another model would answer without the
fine-tune); a key may use an adapter when it may use its base model.
"""

import asyncio
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass

from xinserve.server.errors import APIError
from xinserve.server.pool.model_pool import ModelPool
from xinserve.server.pool.worker_client import WorkerClient

# How long a request whose worker died before its first token waits for another worker of its
# model: long enough for a small model's restart (1 s backoff plus a few seconds of loading),
# short enough that a client gets its 503 while a retry elsewhere is still worth it.
RETRY_WAIT_S = 10.0
_RETRY_POLL_S = 0.1


@dataclass(frozen=True, slots=True)
class Target:
    """What a request's ``model`` names: the served model that runs it, and the LoRA adapter (None: the
    base model itself)."""

    model: str  # the name as the request gave it, which its response repeats
    base: str
    lora_name: str | None = None


def not_found(name: str) -> APIError:
    return APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")


class Router:
    def __init__(self, pools: dict[str, ModelPool]) -> None:
        self.pools = pools
        # Breaks load ties in turn, so idle workers share sequential requests too.
        self._turn = itertools.count()
        self._last_pick: dict[int, int] = {}

    def resolve(self, name: str, may_use: Callable[[str], bool] | None = None) -> Target:
        """The served model or the adapter ``name`` names; 404 for neither, or for a base model the
        request's key may not use."""
        base = name if name in self.pools else self.adapter_base(name)
        if base is None or (may_use is not None and not may_use(base)):
            raise not_found(name)
        return Target(name, base, None if base == name else name)

    def adapter_base(self, name: str) -> str | None:
        """The model that serves LoRA adapter ``name``; None when no model does."""
        return next((pool.name for pool in self.pools.values() if name in pool.adapters), None)

    def chain(self, name: str, may_use: Callable[[str], bool] | None = None) -> list[ModelPool]:
        """The model, then its fallbacks breadth-first, each once.

        ``may_use`` (the request's key, ``xinserve.server.http.auth.may_use``): a model it refuses is not in the
        chain, as if it did not exist, so a key never gets answers (nor errors) from a model it may
        not use through another's fallbacks; None: every model.
        """
        if name not in self.pools or (may_use is not None and not may_use(name)):
            raise not_found(name)
        order, queue = [], [name]
        while queue:
            current = queue.pop(0)
            if current in order or (may_use is not None and not may_use(current)):
                continue
            order.append(current)
            queue.extend(self.pools[current].settings.fallback)
        return [self.pools[n] for n in order]

    def pools_for(self, target: Target, may_use: Callable[[str], bool] | None = None) -> list[ModelPool]:
        """The pools ``target`` may run on, in order: its model's chain, or an adapter's base alone."""
        if target.lora_name is None:
            return self.chain(target.base, may_use)
        pool = self.pools[target.base]
        if target.lora_name not in pool.adapters:  # unloaded since the request resolved it
            raise not_found(target.model)
        return [pool]

    def route(
        self, name: str | Target, n: int = 1, may_use: Callable[[str], bool] | None = None
    ) -> tuple[ModelPool, WorkerClient]:
        """Pick a worker for a request of ``n`` sequences; 404, 429 or 503 as an APIError."""
        target = name if isinstance(name, Target) else Target(name, name)
        for pool in self.pools_for(target, may_use):
            ready = self.serving(pool, target.lora_name)
            if not ready:
                continue  # down (or still loading): try the fallback
            if n > max(w.capacity for w in ready):
                # Would never fit, however long the client retried: a client error, not a 429.
                raise APIError(400, f"n={n} is more than '{pool.name}' can hold at once "
                               f"({max(w.capacity for w in ready)} sequences).", param="n")
            open_workers = [w for w in ready if w.has_capacity(n)]
            if not open_workers:
                # Busy is not down: falling back would hide overload behind another model.
                raise APIError(
                    429, f"The server is overloaded: the waiting queue of '{pool.name}' is full; retry later.",
                    code="queue_full",
                )
            return pool, self._pick(open_workers)
        raise APIError(
            503, f"No worker of model '{target.model}' is ready (loading, failed or dead); see /health.",
            code="model_unavailable",
        )

    @staticmethod
    def serving(pool: ModelPool, lora_name: str | None) -> list[WorkerClient]:
        """``pool``'s ready workers that hold adapter ``lora_name`` (every ready one for None)."""
        ready = pool.ready_workers()
        return ready if lora_name is None else [w for w in ready if lora_name in w.loras.names]

    async def replacement(self, pool: ModelPool, n: int, wait_s: float = RETRY_WAIT_S,
                          lora_name: str | None = None) -> WorkerClient | None:
        """Another worker for a request of ``n`` sequences whose worker died before its first token.

        The least-loaded ready worker of the same pool (its tokenizer made the prompt ids, so no
        fallback model), waiting up to ``wait_s`` for one to be ready and have room (a restart);
        None when none came.
        """
        deadline = time.monotonic() + wait_s
        while True:
            open_workers = [w for w in self.serving(pool, lora_name) if w.has_capacity(n)]
            if open_workers:
                return self._pick(open_workers)
            if time.monotonic() >= deadline:
                return None
            await asyncio.sleep(_RETRY_POLL_S)

    def _pick(self, workers: list[WorkerClient]) -> WorkerClient:
        worker = min(workers, key=lambda w: (w.load, self._last_pick.get(id(w), -1)))
        self._last_pick[id(worker)] = next(self._turn)
        return worker
