"""Model name -> worker: the least-loaded ready worker of the model, else of its fallback chain."""

import itertools

from server.errors import APIError
from server.pool import ModelPool
from server.worker_client import WorkerClient


class Router:
    def __init__(self, pools: dict[str, ModelPool]) -> None:
        self.pools = pools
        # Breaks load ties in turn, so idle workers share sequential requests too.
        self._turn = itertools.count()
        self._last_pick: dict[int, int] = {}

    def chain(self, name: str) -> list[ModelPool]:
        """The model, then its fallbacks breadth-first, each once."""
        if name not in self.pools:
            raise APIError(404, f"The model '{name}' does not exist.", param="model", code="model_not_found")
        order, queue = [], [name]
        while queue:
            current = queue.pop(0)
            if current in order:
                continue
            order.append(current)
            queue.extend(self.pools[current].settings.fallback)
        return [self.pools[n] for n in order]

    def route(self, name: str, n: int = 1) -> tuple[ModelPool, WorkerClient]:
        """Pick a worker for a request of ``n`` sequences; 404, 429 or 503 as an APIError."""
        for pool in self.chain(name):
            ready = pool.ready_workers()
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
            worker = min(open_workers, key=lambda w: (w.load, self._last_pick.get(id(w), -1)))
            self._last_pick[id(worker)] = next(self._turn)
            return pool, worker
        raise APIError(
            503, f"No worker of model '{name}' is ready (loading, failed or dead); see /health.",
            code="model_unavailable",
        )
